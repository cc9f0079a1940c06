"""The benchmarks' CPU meter (issue 38 item 4): this process's CPU and the
local PostgreSQL server's, the time of backends that already exited
included (a connection opened per run ends with the run)."""

from __future__ import annotations

import time

import psycopg
import pytest

from benchmarks.cpu import CpuMeter, server_cpu_seconds
from tests.waiting import WAIT_SECONDS

pytestmark = pytest.mark.django_db

# A statement that keeps its backend busy for a few hundred milliseconds
# of CPU on this machine (more on a slower one).
BUSY = "SELECT count(*) FROM generate_series(1, 3000000) AS g(i) WHERE i % 7 = 3"


def _conninfo() -> str:
    from audit.execution.checkpoint import postgres_conninfo

    return postgres_conninfo()


def test_the_meter_counts_a_backend_that_exited_during_the_block():
    if server_cpu_seconds() is None:
        pytest.skip("this machine's /proc shows no PostgreSQL server process")
    with CpuMeter() as cpu:
        with psycopg.connect(_conninfo()) as conn:
            pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
            conn.execute(BUSY)
        # The backend's time moves to its postmaster once it has exited
        # and been reaped.
        deadline = time.monotonic() + WAIT_SECONDS
        while time.monotonic() < deadline:
            try:
                open(f"/proc/{pid}/stat").close()
            except FileNotFoundError:
                break
            time.sleep(0.05)
    # The statement's CPU was the server's, not this process's.
    assert cpu.server_ms is not None and cpu.server_ms >= 50, cpu.server_ms
    assert cpu.process_ms < cpu.server_ms


def test_the_meter_counts_this_process_in_every_thread():
    import threading

    def spin():
        end = time.process_time() + 0.05
        while time.process_time() < end:
            pass

    with CpuMeter() as cpu:
        worker = threading.Thread(target=spin)
        worker.start()
        worker.join()
    assert cpu.process_ms >= 50
