"""The benchmarks compute every percentile one way: PostgreSQL's
``percentile_cont``, as the dashboard does (issue 41)."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.figures import percentile, summarize


def test_a_percentile_interpolates_between_the_nearest_ranks():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 0.5) == 3.0
    assert percentile(values, 0.95) == pytest.approx(4.8)
    assert percentile([7.0], 0.95) == 7.0
    # The method the audit-write benchmark used before, for every size.
    for size in (2, 3, 10, 41):
        samples = [float(i * i % 17) for i in range(size)]
        expected = statistics.quantiles(sorted(samples), n=20, method="inclusive")[18]
        assert percentile(samples, 0.95) == pytest.approx(expected)


def test_no_samples_is_an_error_not_a_figure():
    with pytest.raises(statistics.StatisticsError):
        percentile([], 0.95)


def test_a_summary_is_in_milliseconds():
    summary = summarize([0.001, 0.002, 0.003])
    assert (summary.count, summary.median_ms) == (3, 2.0)
    assert summary.p95_ms == pytest.approx(2.9)
