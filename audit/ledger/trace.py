"""Storing a run's trace id (R-TRC-1)."""

from __future__ import annotations

from django.db import transaction

from ..models import AgentRun
from .lease import Lease, lock_run


def run_set_trace(*, lease: Lease, trace_id: str) -> None:
    """Store the run's Langfuse trace id (≤ 100 characters), under the lease,
    before the first model call. Raises what :func:`lock_run` raises."""
    with transaction.atomic():
        run = lock_run(lease)
        AgentRun.objects.filter(pk=run.pk).update(trace_id=trace_id[:100])
