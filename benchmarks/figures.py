"""The arithmetic every benchmark shares: a percentile and a latency
summary, so each figure on the performance page is computed one way."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from dashboard.selectors import percentile_cont


def percentile(values: list[float], fraction: float) -> float:
    """The ``fraction`` percentile of ``values`` (0 ≤ fraction ≤ 1),
    interpolated as PostgreSQL's ``percentile_cont`` and the dashboard do
    (:func:`dashboard.selectors.percentile_cont`); one value is its own
    percentile. Raises ``statistics.StatisticsError`` for no values."""
    if not values:
        raise statistics.StatisticsError("no values")
    return percentile_cont(sorted(values), fraction)


@dataclass(frozen=True)
class LatencySummary:
    """Latencies in milliseconds."""

    count: int
    median_ms: float
    p95_ms: float


def summarize(samples_s: list[float]) -> LatencySummary:
    """Median and 95th percentile of ``samples_s`` (seconds) in ms."""
    ms = [s * 1000 for s in samples_s]
    return LatencySummary(count=len(ms), median_ms=statistics.median(ms), p95_ms=percentile(ms, 0.95))
