"""Cost of a lease-checked audit write (``python manage.py bench_audit_writes``).

Measures, in one run against the configured database:

* latency (median, p95) of one ``model_call_start`` through the service —
  its own transaction, the run row locked and checked by
  :func:`~audit.lease.lock_run`, the existing-row check, the insert;
* latency of the equivalent raw SQL transaction (the same lock, checks and
  insert written by hand), and the ratio of the two;
* service writes per second with 1 and with N threads, each thread writing
  into its own run as one worker per run does;
* the cost of the Prometheus metrics on a write (R-OPS-1): the service
  write with metrics switched off, measured alternately with the others,
  and the time of the metric update itself, per write.
* latency of closing a model row (``model_call_finish``) without its cost,
  with the replay models' default prices and with a genai-prices catalogue
  lookup (``openai:gpt-4o-mini``), and the ratio of each to the close
  without cost (R-COST-1: the cost must not slow the close by more than
  10%).

It creates a throw-away user, thread and runs and deletes them at the end.
This is a benchmark, not a test: it prints figures and asserts nothing.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from unittest import mock

from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.utils import timezone

from conversations.models import Conversation, Message
from ops import metrics

from .errors import LeaseLost, RunTerminal
from .lease import Lease
from .models import AgentRun
from .services import model_audit, model_call_finish, model_call_start, run_acquire, run_submit


@dataclass(frozen=True)
class LatencySummary:
    """Latencies in milliseconds."""

    count: int
    median_ms: float
    p95_ms: float


@dataclass(frozen=True)
class BenchResult:
    service: LatencySummary
    raw_sql: LatencySummary
    ratio_median: float
    ratio_p95: float
    writes_per_second: dict[int, float]  # threads -> service writes per second
    service_metrics_off: LatencySummary
    metrics_update_us: float  # one write's metric update, microseconds
    metrics_mode: str  # "multiprocess (<dir>)" or "single process"
    # Model row close: "without cost", "replay default prices",
    # "genai-prices catalogue" -> latency; and each / "without cost".
    close: dict[str, LatencySummary] = field(default_factory=dict)
    close_ratio_median: dict[str, float] = field(default_factory=dict)


def summarize(samples_s: list[float]) -> LatencySummary:
    """Median and 95th percentile of ``samples_s`` (seconds) in ms."""
    ms = sorted(s * 1000 for s in samples_s)
    p95 = statistics.quantiles(ms, n=20, method="inclusive")[18] if len(ms) >= 2 else ms[0]
    return LatencySummary(count=len(ms), median_ms=statistics.median(ms), p95_ms=p95)


class _Fixture:
    """A user with one thread and one leased run per writer."""

    def __init__(self, runs: int):
        self.user = get_user_model().objects.create_user(username=f"bench-{uuid.uuid4().hex[:12]}")
        self.threads: list[Conversation] = []
        self.leases: list[Lease] = [self.add_run("replay:plain_answer") for _ in range(runs)]

    def add_run(self, model: str) -> Lease:
        thread = Conversation.objects.create(user=self.user, agent_id="assistant", model=model)
        run, _ = run_submit(user=self.user, thread_id=thread.id, request_id=f"bench-{uuid.uuid4().hex}", text="x")
        self.threads.append(thread)
        return run_acquire(run_id=run.id, owner=f"bench-{uuid.uuid4().hex[:8]}", ttl_seconds=3600)

    def delete(self) -> None:
        from governance.bypass import audited_bypass

        # Audit rows and runs are append-only (R-GOV-3): the benchmark's own
        # throw-away rows go through the recorded bypass.
        with audited_bypass(reason="bench_audit_writes: delete its throw-away user, threads and runs"):
            self.user.delete()  # cascades to threads, runs and their rows


def _service_write(lease: Lease, operation_id: str, sequence: int) -> None:
    model_call_start(
        lease=lease,
        operation_id=operation_id,
        sequence=sequence,
        started_at=timezone.now(),
        metadata={"namespace": []},
    )


# A close as a real OpenAI call reports it (tokens), with token details.
_CLOSE_USAGE = {
    "input_tokens": 1200,
    "output_tokens": 300,
    "total_tokens": 1500,
    "input_token_details": {"cache_read": 200},
    "output_token_details": {"reasoning": 100},
}


def _close(lease: Lease, operation_id: str, *, with_cost: bool) -> None:
    """``model_call_finish`` of an open row; ``with_cost=False`` skips the
    pricing step (and nothing else) to measure the close without it."""
    skip = mock.patch.object(model_audit, "price_row", lambda row, **_: []) if not with_cost else None
    with skip or contextlib.nullcontext():
        model_call_finish(
            lease=lease,
            operation_id=operation_id,
            content="ok",
            tool_calls=[],
            usage=_CLOSE_USAGE,
            finished_at=timezone.now(),
            duration_ms=5,
            metadata={"model_name": "gpt-4o-mini-2024-07-18", "finish_reason": "stop"},
        )


def _bench_close(fixture: _Fixture, *, writes: int, warmup: int) -> dict[str, LatencySummary]:
    """Latency of closing a model row without cost, with replay default
    prices and with a catalogue lookup; the three alternate so they share
    database state and load. Rows are opened (unmeasured) just before."""
    from costs.pricing import warm_up

    warm_up()
    variants = {
        "without cost": (fixture.add_run("replay:plain_answer"), False),
        "replay default prices": (fixture.add_run("replay:plain_answer"), True),
        "genai-prices catalogue": (fixture.add_run("openai:gpt-4o-mini"), True),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(warmup + writes):
        for name, (lease, with_cost) in variants.items():
            op = f"close-{i}"
            _service_write(lease, op, i + 1)
            elapsed = _timed(partial(_close, lease, op, with_cost=with_cost))
            if i >= warmup:
                samples[name].append(elapsed)
    return {name: summarize(values) for name, values in samples.items()}


def _raw_sql_write(lease: Lease, operation_id: str, sequence: int) -> None:
    """The same transaction as :func:`_service_write`, by hand: lock the run
    row, check identity, owner, fencing token, status and expiry, check for
    the operation, insert the row."""
    run_table, message_table = AgentRun._meta.db_table, Message._meta.db_table
    now = timezone.now()
    row = Message(
        thread_id=lease.thread_id,
        run_id=lease.run_id,
        role=Message.Role.ASSISTANT,
        message_type=Message.Type.MODEL_AUDIT,
        operation_id=operation_id,
        sequence=sequence,
        started_at=now,
        execution_status=Message.ExecutionStatus.RUNNING,
        metadata={"namespace": []},
        created_at=now,
        updated_at=now,
    )
    fields = [f for f in Message._meta.concrete_fields if not f.primary_key]
    columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    values = [f.get_db_prep_save(getattr(row, f.attname), connection) for f in fields]
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"SELECT request_id, thread_id, lease_owner, fencing_token, status, lease_expires_at "
            f"FROM {run_table} WHERE id = %s FOR NO KEY UPDATE",
            [lease.run_id],
        )
        found = cursor.fetchone()
        if found is None or found[0] != lease.request_id or found[1] != lease.thread_id:
            raise LeaseLost("identity")
        if found[2] != lease.owner or found[3] != lease.fencing_token:
            raise LeaseLost("owner")
        if found[4] in AgentRun.TERMINAL_STATUSES:
            raise RunTerminal("terminal")
        if found[5] is None or found[5] <= now:
            raise LeaseLost("expired")
        cursor.execute(
            f"SELECT sequence FROM {message_table} WHERE run_id = %s AND role = %s AND operation_id = %s",
            [lease.run_id, Message.Role.ASSISTANT, operation_id],
        )
        if cursor.fetchone() is not None:
            return
        cursor.execute(
            f"INSERT INTO {message_table} ({columns}) VALUES ({', '.join(['%s'] * len(values))})",
            values,
        )


def _timed(fn: Callable[[], None]) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def _timed_metrics_off(fn: Callable[[], None]) -> float:
    previous, metrics.enabled = metrics.enabled, False
    try:
        return _timed(fn)
    finally:
        metrics.enabled = previous


def _metric_update_us(samples: int = 20_000) -> float:
    """Microseconds of what :func:`ops.metrics.audit_write` adds to one
    write: two clock reads and one histogram observation."""
    histogram = metrics.AUDIT_WRITE_DURATION.labels("bench")
    began = time.perf_counter()
    for _ in range(samples):
        start = time.perf_counter()
        histogram.observe(time.perf_counter() - start)
    return (time.perf_counter() - began) / samples * 1e6


def _throughput(fixture: _Fixture, threads: int, writes_per_thread: int) -> float:
    """Service writes per second with ``threads`` threads, one run each."""
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def writer(index: int) -> None:
        lease = fixture.leases[index]
        try:
            barrier.wait()
            for i in range(writes_per_thread):
                _service_write(lease, f"tp{threads}-{index}-{i}", 1_000_000 + i)
        except BaseException as exc:  # reported after join
            errors.append(exc)
        finally:
            connection.close()

    workers = [threading.Thread(target=writer, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    barrier.wait()
    began = time.perf_counter()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - began
    if errors:
        raise errors[0]
    return threads * writes_per_thread / elapsed


def bench_audit_writes(*, writes: int = 500, warmup: int = 50, thread_counts: tuple[int, ...] = (1, 8)) -> BenchResult:
    """Run the benchmark.

    Args:
        writes: measured writes per path for the latency figures, and per
            thread for the throughput figures.
        warmup: unmeasured writes per path first (connection, caches).
        thread_counts: thread counts for the throughput figures.

    The service writes with metrics on and off and the raw SQL writes
    alternate, so all see the same database state and load. Returns the
    figures; prints nothing.
    """
    fixture = _Fixture(runs=max(3, *thread_counts))
    try:
        service_lease, raw_lease, off_lease = fixture.leases[0], fixture.leases[1], fixture.leases[2]
        for i in range(warmup):
            _service_write(service_lease, f"warm-s-{i}", i + 1)
            _raw_sql_write(raw_lease, f"warm-r-{i}", i + 1)
            _timed_metrics_off(partial(_service_write, off_lease, f"warm-o-{i}", i + 1))
        service, raw, off = [], [], []
        for i in range(writes):
            seq = warmup + i + 1
            service.append(_timed(partial(_service_write, service_lease, f"s-{i}", seq)))
            raw.append(_timed(partial(_raw_sql_write, raw_lease, f"r-{i}", seq)))
            off.append(_timed_metrics_off(partial(_service_write, off_lease, f"o-{i}", seq)))
        service_summary, raw_summary = summarize(service), summarize(raw)
        close = _bench_close(fixture, writes=writes, warmup=warmup)
        connection.close()  # the threads below take their own connections
        per_second = {n: _throughput(fixture, n, writes) for n in thread_counts}
        base = close["without cost"].median_ms
        return BenchResult(
            service=service_summary,
            raw_sql=raw_summary,
            ratio_median=service_summary.median_ms / raw_summary.median_ms,
            ratio_p95=service_summary.p95_ms / raw_summary.p95_ms,
            writes_per_second=per_second,
            service_metrics_off=summarize(off),
            metrics_update_us=_metric_update_us(),
            metrics_mode=f"multiprocess ({metrics.multiprocess_dir()})"
            if metrics.multiprocess_dir()
            else "single process",
            close=close,
            close_ratio_median={name: summary.median_ms / base for name, summary in close.items()},
        )
    finally:
        fixture.delete()
