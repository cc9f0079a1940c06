"""CPU time spent by a piece of work, beside its wall time (issue 38 item
4): this process's (every thread, ``CLOCK_PROCESS_CPUTIME_ID``) and the
local PostgreSQL server's.

Wall-time differences of ~100 ms medians swing with the machine's load;
CPU time is what the work itself costs, so a benchmark reports both. The
server's CPU is read from Linux ``/proc``: every ``postgres`` process's
user and system time, plus what its postmasters collected from backends
that already exited (a connection opened per run ends with the run, and
its backend's time moves to the postmaster's ``cutime``/``cstime``). The
kernel counts it in clock ticks (10 ms here), so one run's figure is
coarse: average it over many runs, never take a median of it. Every
PostgreSQL server of the machine is counted: run the benchmark on a
machine where nothing else uses one.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PROC = Path("/proc")


class CpuMeter:
    """``with CpuMeter() as cpu: work()``, then ``cpu.process_ms`` and
    ``cpu.server_ms`` (None where ``/proc`` cannot tell): the CPU
    milliseconds the block took in this process and in the PostgreSQL
    servers. The server is read outside the process's window, so reading
    ``/proc`` is not counted as the work's."""

    process_ms: float = 0.0
    server_ms: float | None = None

    def __enter__(self) -> CpuMeter:
        self._server = server_cpu_seconds()
        self._process = time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.process_ms = (time.process_time() - self._process) * 1000
        server = server_cpu_seconds()
        if server is not None and self._server is not None:
            self.server_ms = (server - self._server) * 1000


def server_cpu_seconds() -> float | None:
    """CPU seconds of every ``postgres`` process of this machine, the exited
    backends' included (their postmasters' children time); None without a
    readable ``/proc`` or without any such process."""
    if not _PROC.is_dir():
        return None
    stats: dict[int, tuple[int, list[str]]] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        name_end = text.rfind(")")
        if text[text.find("(") + 1 : name_end] != "postgres":
            continue
        fields = text[name_end + 2 :].split()
        stats[int(entry.name)] = (int(fields[1]), fields)
    if not stats:
        return None
    ticks = 0
    for ppid, fields in stats.values():
        # Fields after the name: state, ppid, …; utime and stime are the
        # 12th and 13th, cutime and cstime the 14th and 15th (proc(5)).
        ticks += int(fields[11]) + int(fields[12])
        if ppid not in stats:  # a postmaster: its exited backends too
            ticks += int(fields[13]) + int(fields[14])
    return ticks / _TICK
