"""``/metrics`` across real processes sharing ``PROMETHEUS_MULTIPROC_DIR``
(R-OPS-1): the open-streams gauge counts only processes that are alive — a
web process that was killed (or has ended and is not yet reaped) stops
counting at the next scrape — while the counters keep what it counted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from prometheus_client.parser import text_string_to_metric_families

from ops import exposition
from tests.waiting import WAIT_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A stand-in for a web process serving ``streams`` live streams.
SERVING = (
    "import sys, time, django; django.setup(); from ops import metrics; "
    "[(metrics.SSE_STREAMS_OPEN.inc(), metrics.SSE_STREAMS.inc()) for _ in range(int(sys.argv[1]))]; "
    "print('serving', flush=True); time.sleep(600)"
)


def _env(directory) -> dict[str, str]:
    return {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(directory),
        "DJANGO_SETTINGS_MODULE": "yuxi_project.settings",
        "PYTHONPATH": ROOT,
    }


def _serving(directory, streams: int) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-c", SERVING, str(streams)],
        cwd=ROOT,
        env=_env(directory),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout.readline().strip() == "serving"
    return process


def _scrape(directory, monkeypatch) -> dict[str, float]:
    """What ``/metrics`` serves from ``directory`` (this process's own
    values are not in it: they are not kept in files)."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
    figures = {"yuxi_sse_streams_open": 0.0, "yuxi_sse_streams_total": 0.0}  # no process: no sample
    for family in text_string_to_metric_families(exposition.render().decode()):
        for sample in family.samples:
            if sample.name in figures:
                figures[sample.name] += sample.value
    return figures


def test_open_streams_of_a_killed_process_stop_counting_and_its_counters_stay_R_OPS_1(tmp_path, monkeypatch):
    killed, alive = _serving(tmp_path, 2), _serving(tmp_path, 1)
    try:
        assert _scrape(tmp_path, monkeypatch) == {"yuxi_sse_streams_open": 3, "yuxi_sse_streams_total": 3}
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        assert _scrape(tmp_path, monkeypatch) == {"yuxi_sse_streams_open": 1, "yuxi_sse_streams_total": 3}
        assert not list(tmp_path.glob(f"gauge_live*_{killed.pid}.db")), "the dead process's live gauge is gone"
        # Its counters are kept in the archive, not in a file of its own.
        assert not list(tmp_path.glob(f"counter_{killed.pid}.db"))
        assert (tmp_path / "counter_archive.db").exists()
        # Ended but not yet reaped by its parent (a zombie): it serves
        # nothing either.
        alive.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + WAIT_SECONDS
        while not _zombie(alive.pid):
            assert time.monotonic() < deadline, "the process never ended"
            time.sleep(0.05)
        assert _scrape(tmp_path, monkeypatch) == {"yuxi_sse_streams_open": 0, "yuxi_sse_streams_total": 3}
    finally:
        for process in (killed, alive):
            process.kill()
            process.wait(30)


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
