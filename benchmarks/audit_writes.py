"""Cost of a lease-checked audit write (``python manage.py bench_audit_writes``).

Measures, in one run against the configured database:

* latency (median, p95) of one ``model_call_start`` through the service —
  one statement that locks the run row, checks the lease
  (:func:`~audit.ledger.fenced.leased_run_sql`) and inserts the row;
* latency of the raw SQL baseline — plain psycopg on its own connection:
  ``BEGIN``; lock the run row and compare its lease fields; ``INSERT`` one
  message row; ``COMMIT`` — and the ratio of the two (target: at most
  1.5x);
* writes per second of the service and of the baseline with 1 and with N
  threads, each thread writing into its own run as one worker per run does
  (target at 8 threads: the service at least 2/3 of the baseline);
* all of the above in interleaved rounds, reported as the median over the
  rounds;
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
from django.db import connection
from django.utils import timezone

from audit.errors import LeaseLost, RunTerminal
from audit.ledger import model_audit, model_call_finish, model_call_start, run_acquire, run_submit
from audit.ledger.lease import Lease
from audit.models import AgentRun
from conversations.models import Conversation, Message
from costs.pricing import Cost
from ops import metrics

from .figures import LatencySummary, summarize


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
    raw_writes_per_second: dict[int, float] = field(default_factory=dict)  # the baseline's, per thread count
    rounds: int = 1
    # Per round: median latency (ms) of "service" and "raw" and their "ratio".
    round_median_ms: dict[str, list[float]] = field(default_factory=dict)
    # threads -> {"service": [per round], "raw": [per round]} writes per second.
    round_writes_per_second: dict[int, dict[str, list[float]]] = field(default_factory=dict)


class _Fixture:
    """A user with one thread and one leased run per writer."""

    def __init__(self, runs: int):
        self.user = get_user_model().objects.create_user(username=f"bench-{uuid.uuid4().hex[:12]}")
        self.threads: list[Conversation] = []
        try:
            self.leases: list[Lease] = [self.add_run("replay:plain_answer") for _ in range(runs)]
        except BaseException:
            self.delete()  # nothing of a failed start stays behind
            raise

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


# What the close stores when its pricing step is skipped: no cost, no
# reason (the statement is the same, its cost columns empty).
_NO_PRICE = Cost(usd=None)


def _close(lease: Lease, operation_id: str, *, with_cost: bool) -> None:
    """``model_call_finish`` of an open row; ``with_cost=False`` skips the
    pricing step (and nothing else) to measure the close without it."""
    skip = mock.patch.object(model_audit, "price_usage", lambda **_: _NO_PRICE) if not with_cost else None
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


class _RawWriter:
    """The baseline: the same work as one service write, in plain psycopg
    on its own connection (no Django, no pool) — ``BEGIN``; lock the run row
    and compare its lease fields; ``INSERT`` one message row; ``COMMIT``."""

    _GIVEN = frozenset(
        (
            "thread_id",
            "run_id",
            "role",
            "message_type",
            "content",
            "tool_calls",
            "metadata",
            "operation_id",
            "started_at",
            "sequence",
            "execution_status",
            "price_source",
            "price_version",
            "tool_name",
            "created_at",
            "updated_at",
        )
    )

    def __init__(self):
        import psycopg

        from audit.execution.checkpoint import postgres_conninfo

        self.conn = psycopg.connect(postgres_conninfo())
        run_table, message_table = AgentRun._meta.db_table, Message._meta.db_table
        # The columns the baseline sets itself; every other column gets its
        # database default, or the model's default (columns added later).
        fields = [f for f in Message._meta.concrete_fields if not f.primary_key and not f.generated]
        given = {f for f in fields if f.attname in self._GIVEN}
        self.fields = [f for f in fields if f in given or not f.has_db_default()]
        self.defaults = {
            f.attname: f.get_db_prep_save(f.get_default(), connection) for f in self.fields if f not in given
        }
        columns = ", ".join(connection.ops.quote_name(f.column) for f in self.fields)
        self.lock_sql = (
            f"SELECT request_id, thread_id, lease_owner, fencing_token, status, lease_expires_at "
            f"FROM {run_table} WHERE id = %s FOR NO KEY UPDATE"
        )
        self.insert_sql = f"INSERT INTO {message_table} ({columns}) VALUES ({', '.join(['%s'] * len(self.fields))})"

    def write(self, lease: Lease, operation_id: str, sequence: int) -> None:
        from psycopg.types.json import Jsonb

        now = timezone.now()
        values = {
            "thread_id": lease.thread_id,
            "run_id": lease.run_id,
            "role": Message.Role.ASSISTANT,
            "message_type": Message.Type.MODEL_AUDIT,
            "content": "",
            "tool_calls": None,
            "metadata": Jsonb({"namespace": []}),
            "operation_id": operation_id,
            "started_at": now,
            "sequence": sequence,
            "execution_status": Message.ExecutionStatus.RUNNING,
            "price_source": "",
            "price_version": "",
            "tool_name": "",
            "created_at": now,
            "updated_at": now,
        }
        with self.conn.transaction():
            found = self.conn.execute(self.lock_sql, [lease.run_id]).fetchone()
            if found is None or found[0] != lease.request_id or found[1] != lease.thread_id:
                raise LeaseLost("identity")
            if found[2] != lease.owner or found[3] != lease.fencing_token:
                raise LeaseLost("owner")
            if found[4] in AgentRun.TERMINAL_STATUSES:
                raise RunTerminal("terminal")
            if found[5] is None or found[5] <= now:
                raise LeaseLost("expired")
            self.conn.execute(
                self.insert_sql,
                [values[f.attname] if f.attname in values else self.defaults[f.attname] for f in self.fields],
            )

    def close(self) -> None:
        self.conn.close()


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


def _throughput(fixture: _Fixture, threads: int, writes_per_thread: int, *, raw: bool, tag: str) -> float:
    """Writes per second with ``threads`` threads, one run each: through the
    service, or (``raw``) the plain psycopg baseline, one connection each."""
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def writer(index: int) -> None:
        lease = fixture.leases[index]
        raw_writer = _RawWriter() if raw else None
        try:
            write = raw_writer.write if raw_writer else _service_write
            write(lease, f"{tag}-warm-{index}", 999_999)  # connection opened before the clock starts
            barrier.wait()
            for i in range(writes_per_thread):
                write(lease, f"{tag}-{index}-{i}", 1_000_000 + i)
        except BaseException as exc:  # reported after join
            errors.append(exc)
            barrier.abort()
        finally:
            if raw_writer:
                raw_writer.close()
            connection.close()

    workers = [threading.Thread(target=writer, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        barrier.wait()
    began = time.perf_counter()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - began
    if errors:
        raise errors[0]
    return threads * writes_per_thread / elapsed


def bench_audit_writes(
    *, writes: int = 500, warmup: int = 50, thread_counts: tuple[int, ...] = (1, 8), rounds: int = 1
) -> BenchResult:
    """Run the benchmark.

    Args:
        writes: measured writes per path and round for the latency figures,
            and per thread and round for the throughput figures.
        warmup: unmeasured writes per path first (connection, caches).
        thread_counts: thread counts for the throughput figures.
        rounds: rounds of the service/raw comparison; in each round the
            service writes, the raw SQL writes and the service writes with
            metrics off alternate one by one, then the throughput of both
            is measured at each thread count, raw and service alternating.
            Figures are the median over the rounds (each round's median
            latency, each round's writes per second).

    Returns the figures; prints nothing.
    """
    fixture = _Fixture(runs=max(3, *thread_counts))
    raw_writer = _RawWriter()
    try:
        service_lease, raw_lease, off_lease = fixture.leases[0], fixture.leases[1], fixture.leases[2]
        for i in range(warmup):
            _service_write(service_lease, f"warm-s-{i}", i + 1)
            raw_writer.write(raw_lease, f"warm-r-{i}", i + 1)
            _timed_metrics_off(partial(_service_write, off_lease, f"warm-o-{i}", i + 1))
        service, raw, off = [], [], []
        round_service, round_raw, round_ratio = [], [], []
        per_second: dict[int, list[float]] = {n: [] for n in thread_counts}
        raw_per_second: dict[int, list[float]] = {n: [] for n in thread_counts}
        for r in range(rounds):
            s_round, r_round = [], []
            for i in range(writes):
                seq = warmup + r * writes + i + 1
                s_round.append(_timed(partial(_service_write, service_lease, f"s-{r}-{i}", seq)))
                r_round.append(_timed(partial(raw_writer.write, raw_lease, f"r-{r}-{i}", seq)))
                off.append(_timed_metrics_off(partial(_service_write, off_lease, f"o-{r}-{i}", seq)))
            service += s_round
            raw += r_round
            round_service.append(statistics.median(s_round) * 1000)
            round_raw.append(statistics.median(r_round) * 1000)
            round_ratio.append(round_service[-1] / round_raw[-1])
            connection.close()  # the threads below take their own connections
            for n in thread_counts:
                raw_per_second[n].append(_throughput(fixture, n, writes, raw=True, tag=f"tr{r}-{n}"))
                per_second[n].append(_throughput(fixture, n, writes, raw=False, tag=f"ts{r}-{n}"))
        service_summary, raw_summary = summarize(service), summarize(raw)
        close = _bench_close(fixture, writes=writes, warmup=warmup)
        base = close["without cost"].median_ms
        return BenchResult(
            service=service_summary,
            raw_sql=raw_summary,
            ratio_median=statistics.median(round_ratio),
            ratio_p95=service_summary.p95_ms / raw_summary.p95_ms,
            writes_per_second={n: statistics.median(v) for n, v in per_second.items()},
            service_metrics_off=summarize(off),
            metrics_update_us=_metric_update_us(),
            metrics_mode=f"multiprocess ({metrics.multiprocess_dir()})"
            if metrics.multiprocess_dir()
            else "single process",
            close=close,
            close_ratio_median={name: summary.median_ms / base for name, summary in close.items()},
            raw_writes_per_second={n: statistics.median(v) for n, v in raw_per_second.items()},
            rounds=rounds,
            round_median_ms={"service": round_service, "raw": round_raw, "ratio": round_ratio},
            round_writes_per_second={n: {"service": per_second[n], "raw": raw_per_second[n]} for n in thread_counts},
        )
    finally:
        raw_writer.close()
        fixture.delete()
