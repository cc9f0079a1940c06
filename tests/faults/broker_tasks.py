"""A task for :mod:`tests.faults.test_broker_loss` only, loaded into a real
worker with ``celery worker --include tests.faults.broker_tasks``: it holds
its (late-acknowledged) message for a while, then says it ran by writing a
file, so the test can tell without the broker."""

from __future__ import annotations

import time
from pathlib import Path

from celery import shared_task


@shared_task(name="tests.faults.hold")
def hold(seconds: float, marker: str) -> None:
    """Sleep ``seconds`` (s), then write ``marker`` (a file path)."""
    time.sleep(seconds)
    Path(marker).write_text("ran")
