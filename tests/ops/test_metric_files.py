"""The files of processes that ended are summed into one archive set before
a scrape (``ops.metric_files``, R-OPS-1, issue 38): the exposition stays
what prometheus-client's own collector makes of the files as written, a
compaction cut after its commit is finished by the next one and counts
nothing twice, and one cut before it leaves the files as they were."""

from __future__ import annotations

import os
import shutil

import pytest
from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.parser import text_string_to_metric_families

from ops import exposition, metric_files

#: Above any kernel's pid_max: processes that have ended.
ENDED = [(1 << 23) + 1, (1 << 23) + 2]
LIVE = os.getpid()
COUNTER_HELP = "Tool executions."
HISTOGRAM_HELP = "Durations."


def write_files(directory, pid: int, scale: float) -> None:
    counter = MmapedDict(str(directory / f"counter_{pid}.db"))
    for tool in ("calculator", "lookup"):
        key = mmap_key("yuxi_t", "yuxi_t_total", ["tool"], [tool], COUNTER_HELP)
        counter.write_value(key, 2 * scale, 0.0)
    counter.close()
    histogram = MmapedDict(str(directory / f"histogram_{pid}.db"))
    histogram.write_value(mmap_key("yuxi_d", "yuxi_d_sum", [], [], HISTOGRAM_HELP), 1.5 * scale, 0.0)
    for bound, count in (("0.5", 1), ("1.0", 2), ("+Inf", 1)):
        key = mmap_key("yuxi_d", "yuxi_d_bucket", ["le"], [bound], HISTOGRAM_HELP)
        histogram.write_value(key, count * scale, 0.0)
    histogram.close()


def samples(text: str) -> dict:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith(("yuxi_t", "yuxi_d"))
        for sample in family.samples
    }


def as_written(directory) -> dict:
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(directory))
    return samples(generate_latest(registry).decode())


@pytest.fixture
def directory(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    for scale, pid in enumerate([*ENDED, LIVE], start=1):
        write_files(tmp_path, pid, scale)
    return tmp_path


def names(directory) -> set[str]:
    return {name for name in os.listdir(directory) if name.endswith(".db")}


@pytest.mark.django_db
def test_a_scrape_sums_the_ended_processes_files_into_the_archive_and_serves_the_same_figures(
    directory, tmp_path_factory
):
    copy = tmp_path_factory.mktemp("as-written")
    shutil.copytree(directory, copy, dirs_exist_ok=True)
    expected = as_written(copy)
    assert expected[("yuxi_t_total", (("tool", "lookup"),))] == 2 + 4 + 6

    assert samples(exposition.render().decode()) == expected

    assert names(directory) == {
        "counter_archive.db",
        "histogram_archive.db",
        f"counter_{LIVE}.db",
        f"histogram_{LIVE}.db",
    }
    # More processes end: they join the archive, which is counted once.
    write_files(directory, ENDED[0] + 10, 10)
    write_files(copy, ENDED[0] + 10, 10)
    assert metric_files.compact_dead_processes(str(directory)) == [ENDED[0] + 10]
    assert samples(exposition.render().decode()) == as_written(copy)
    assert as_written(directory) == as_written(copy)
    assert metric_files.compact_dead_processes(str(directory)) == []


def test_a_compaction_cut_after_its_commit_is_finished_by_the_next_and_counts_nothing_twice(directory, monkeypatch):
    expected = as_written(directory)
    finish = metric_files._finish_journal

    def cut_after_the_commit(path):
        if os.path.exists(os.path.join(path, metric_files.JOURNAL_FILE)):
            raise KeyboardInterrupt("the process stopped here")
        finish(path)

    monkeypatch.setattr(metric_files, "_finish_journal", cut_after_the_commit)
    with pytest.raises(KeyboardInterrupt):
        metric_files.compact_dead_processes(str(directory))
    monkeypatch.setattr(metric_files, "_finish_journal", finish)
    # Committed, not carried out: the archive is pending, the files stay.
    assert f"counter_{ENDED[0]}.db" in names(directory)
    assert "counter_archive.db" not in names(directory)

    assert metric_files.compact_dead_processes(str(directory)) == []
    assert not os.path.exists(directory / metric_files.JOURNAL_FILE)
    assert f"counter_{ENDED[0]}.db" not in names(directory)
    assert as_written(directory) == expected


def test_a_compaction_cut_before_its_commit_leaves_the_files_as_they_were(directory, monkeypatch):
    expected = as_written(directory)

    def cut_before_the_commit(path, plan):
        raise KeyboardInterrupt("the process stopped here")

    monkeypatch.setattr(metric_files, "_commit_journal", cut_before_the_commit)
    with pytest.raises(KeyboardInterrupt):
        metric_files.compact_dead_processes(str(directory))
    monkeypatch.undo()
    assert any(name.endswith(".pending") for name in os.listdir(directory))
    assert as_written(directory) == expected

    assert metric_files.compact_dead_processes(str(directory)) == ENDED
    assert not any(name.endswith(".pending") for name in os.listdir(directory))
    assert as_written(directory) == expected
