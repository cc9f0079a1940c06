"""A worker told to stop hands its runs over at once (R-RUN-15).

A rolling deploy stops workers with SIGTERM: Celery's warm shutdown stops
consuming and waits for the running tasks, and a platform kills the worker
after its grace period — the runs would then wait for their lease to expire.
Instead, with ``RUN_RECOVERY=resume``, each run of a stopping worker stops
at its next step boundary (a running tool is waited for, up to one lease
TTL, so that its outcome is known) and puts itself back to ``pending`` as
its next attempt in one lease-fenced transaction
(:func:`audit.ledger.terminal.run_hand_over`); another worker continues it
from its last checkpoint, and the task returns, so the warm shutdown ends.

The main process of a prefork worker gets the SIGTERM; its pool processes
run the runs. :func:`signal_pool_processes` (called from Celery's
``worker_shutting_down`` in the main process) sends each pool process
:data:`HANDOVER_SIGNAL`, whose handler (:func:`install_handover_handler`,
installed when a pool process starts) sets this process's flag; a run's
lease keeper reads it at every poll (about once a second).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterable

log = logging.getLogger(__name__)

#: The signal a stopping worker's main process sends its pool processes.
#: SIGUSR2: Celery's pool processes reset SIGTERM and SIGUSR1 to their
#: defaults and leave this one alone.
HANDOVER_SIGNAL = signal.SIGUSR2

_requested = threading.Event()


def request_handover() -> None:
    """Ask every run of this process to hand itself over (idempotent)."""
    _requested.set()


def handover_requested() -> bool:
    """Whether this process was asked to hand its runs over."""
    return _requested.is_set()


def clear_handover() -> None:
    """Forget a hand-over request (a test that made one)."""
    _requested.clear()


def install_handover_handler() -> None:
    """Make :data:`HANDOVER_SIGNAL` ask this process's runs to hand
    themselves over. Call in the process's main thread (a pool process's
    start)."""
    signal.signal(HANDOVER_SIGNAL, lambda _signum, _frame: request_handover())


def signal_pool_processes(pids: Iterable[int]) -> list[int]:
    """Send :data:`HANDOVER_SIGNAL` to each of ``pids`` (a stopping worker's
    pool processes); returns those it reached. A process gone already is
    skipped. Safe in a signal handler."""
    reached = []
    for pid in pids:
        if pid == os.getpid():
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, HANDOVER_SIGNAL)
            reached.append(pid)
    return reached
