"""What sealing adds to the terminal transaction (``python manage.py
bench_seal``, R-GOV-3).

Drives runs through the real services (lease, model and tool rows closed
by their lifecycles), then times their terminal transaction
(:func:`audit.ledger.run_finish`) alternately with the seal and with the
seal switched off, and times the seal's own work (reading the run's rows
and hashing them). Creates a throw-away user, threads and runs and deletes
them at the end through the recorded bypass. A benchmark, not a test: it
prints figures and asserts nothing.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from dataclasses import dataclass
from unittest import mock

from django.contrib.auth import get_user_model
from django.utils import timezone

from audit import ledger
from audit.ledger import StateMessage
from conversations.models import Conversation
from governance.seal import recompute_seal

from .databases import throwaway_user_delete
from .figures import LatencySummary, summarize


@dataclass(frozen=True)
class SealBench:
    rows_per_run: int
    with_seal: LatencySummary
    without_seal: LatencySummary
    seal_alone: LatencySummary

    @property
    def ratio_median(self) -> float:
        return self.with_seal.median_ms / self.without_seal.median_ms


def _driven_run(user, thread, rows: int):
    run, _ = ledger.run_submit(user=user, thread_id=thread.id, request_id=f"bench-{uuid.uuid4().hex}", text="x")
    lease = ledger.run_acquire(run_id=run.id, owner=f"bench-{uuid.uuid4().hex[:8]}", ttl_seconds=3600)
    state = [StateMessage(kind="human", id=f"h-{run.id}", content="x")]
    now = timezone.now()
    for i in range(rows // 2):
        op, call = f"lc_run--bench-{i}", f"call_bench_{i}"
        ledger.model_call_start(lease=lease, operation_id=op, sequence=2 * i + 1, started_at=now, metadata={})
        ledger.model_call_finish(
            lease=lease,
            operation_id=op,
            content="",
            tool_calls=[{"id": call, "name": "calculator", "args": {"expression": "1+1"}}],
            usage={"input_tokens": 50, "output_tokens": 10, "total_tokens": 60},
            finished_at=now,
            duration_ms=5,
        )
        ledger.tool_call_start(
            lease=lease,
            tool_call_id=call,
            tool_name="calculator",
            tool_input={"expression": "1+1"},
            sequence=2 * i + 2,
            started_at=now,
            declared_by_operation_id=op,
            metadata={},
        )
        ledger.tool_call_finish(
            lease=lease,
            tool_call_id=call,
            status="completed",
            content="2",
            raw_output={"content": "2"},
            finished_at=now,
            duration_ms=1,
        )
        state.append(StateMessage(kind="ai", id=op, tool_calls=[{"id": call, "name": "calculator", "args": {}}]))
    return run, lease, state


def bench_seal(*, runs: int = 40, rows: int = 10) -> SealBench:
    """Median and p95 (ms) of ``run_finish`` with and without the seal over
    ``runs`` runs of ``rows`` audit rows each (half each way, alternating),
    and of the seal's own work on the sealed runs."""
    first_day = timezone.now().astimezone(dt.UTC).date()
    user = get_user_model().objects.create_user(username=f"bench-seal-{uuid.uuid4().hex[:10]}")
    with_seal, without_seal, alone = [], [], []
    try:
        sealed = []
        for i in range(runs):
            thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
            run, lease, state = _driven_run(user, thread, rows)
            seal_on = i % 2 == 0
            started = time.perf_counter()
            if seal_on:
                ledger.run_finish(lease=lease, status="completed", final_state=state)
                with_seal.append(time.perf_counter() - started)
                sealed.append(run.pk)
            else:
                with mock.patch("audit.ledger.terminal.seal_run"):
                    ledger.run_finish(lease=lease, status="completed", final_state=state)
                without_seal.append(time.perf_counter() - started)
        for run_id in sealed:
            started = time.perf_counter()
            recompute_seal(run_id)
            alone.append(time.perf_counter() - started)
    finally:
        throwaway_user_delete(user, bench="bench_seal", since=first_day)
    return SealBench(
        rows_per_run=rows,
        with_seal=summarize(with_seal),
        without_seal=summarize(without_seal),
        seal_alone=summarize(alone),
    )
