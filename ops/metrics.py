"""Prometheus metrics of runs, audit writes, leases, tools and live streams (R-OPS-1).

Processes: the web server and every Celery worker process record into
``prometheus_client``. With ``PROMETHEUS_MULTIPROC_DIR`` set (the same empty
directory for every process of one deployment, emptied before they start)
the client keeps each process's values in files there, so prefork children,
several workers and the web report together. Without it each process keeps
its own values (fine for a first look, wrong for a deployment). The scrape
itself — ``GET /metrics`` and the queue gauges read from PostgreSQL — is
:mod:`ops.exposition`.

This module records only: it sits in the foundation layer, below the
ledger services, the run execution and the API that call it, and reads no
table: what it counts per run comes from the rows its caller passes.

What is counted where:

* Run ends, run duration, model calls (duration, tokens, cost) and tool
  executions are recorded once per run, after the run's terminal
  transaction committed (:func:`run_ended`), from the run's audit rows as
  that transaction wrote them. So they agree with the audit exactly — also for rows the
  terminal transaction closed or reconciled and for runs the lease sweeper
  ended — and a rolled-back terminal write counts nothing.
* Audit-write latency and refusals: every lease-checked service call
  (:func:`audit_write`, a decorator), measured around its transaction.
* Lease acquisitions, renewals, expiries and takeovers: after commit.
* Pending-queue depth, age of the oldest startable pending run, active
  runs: not here; read from PostgreSQL at scrape time
  (:class:`ops.exposition.QueueCollector`).
* Open SSE streams (:func:`track_sse`) and dispatcher re-enqueues
  (:func:`record_reenqueue`).

Labels are bounded: status, error type (its part before ``:``), the run's
configured model name (unknown names become ``other``), tool name, write
kind. No run, thread or user id is ever a label.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import datetime
from typing import Any

from django.core.exceptions import SynchronousOnlyOperation
from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

from audit.catalogue import available_models
from core.config import get_config
from core.db import NeedsThread

log = logging.getLogger(__name__)

# ``_created`` series double every counter for no use on a dashboard (and do
# not exist in multiprocess mode): the same output in both modes.
disable_created_metrics()

#: False switches every recording function off (``METRICS_ENABLED=false``,
#: and the benchmark's "metrics off" half). Scrapes still answer.
enabled = get_config().METRICS_ENABLED

_RUN_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
_MODEL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
_WRITE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)

RUNS_FINISHED = Counter(
    "yuxi_runs_finished",
    "Runs that reached a terminal status, by status, error type and model.",
    ["status", "error_type", "model"],
)
RUN_DURATION = Histogram(
    "yuxi_run_duration_seconds",
    "Wall time of a run from its lease acquisition to its terminal transaction, by model and status.",
    ["model", "status"],
    buckets=_RUN_BUCKETS,
)
MODEL_CALLS = Counter(
    "yuxi_model_calls",
    "Model calls (model_audit rows) of ended runs, by model and row status.",
    ["model", "status"],
)
MODEL_CALL_DURATION = Histogram(
    "yuxi_model_call_duration_seconds",
    "Duration of a model call from message-start to message-finish, by model.",
    ["model"],
    buckets=_MODEL_BUCKETS,
)
MODEL_TOKENS = Counter(
    "yuxi_model_tokens",
    "Tokens reported by the provider, by model and kind "
    "(input, output, cache_read, cache_creation, reasoning; details are part of input/output).",
    ["model", "kind"],
)
MODEL_CALLS_USAGE_UNKNOWN = Counter(
    "yuxi_model_calls_usage_unknown",
    "Model calls closed without usage (cut off before the provider reported it), by model.",
    ["model"],
)
MODEL_COST = Counter(
    "yuxi_model_cost_usd",
    "Cost in USD of model calls with a known cost, by model (present once model rows carry cost_usd).",
    ["model"],
)
MODEL_CALLS_COST_UNKNOWN = Counter(
    "yuxi_model_calls_cost_unknown",
    "Model calls whose cost is unknown (no usage or no price), by model.",
    ["model"],
)
TOOL_EXECUTIONS = Counter(
    "yuxi_tool_executions",
    "Tool executions (tool rows that started) of ended runs, by tool and final status.",
    ["tool", "status"],
)
TOOL_DURATION = Histogram(
    "yuxi_tool_execution_duration_seconds",
    "Duration of a tool execution from tool-started to tool-finished, by tool.",
    ["tool"],
    buckets=_MODEL_BUCKETS,
)
AUDIT_WRITE_DURATION = Histogram(
    "yuxi_audit_write_duration_seconds",
    "Latency of one lease-checked audit write (its whole transaction), by write kind.",
    ["kind"],
    buckets=_WRITE_BUCKETS,
)
AUDIT_WRITE_ERRORS = Counter(
    "yuxi_audit_write_errors",
    "Lease-checked audit writes that raised, by write kind and error class "
    "(database errors are retried; LeaseLost/LeaseExpired/RunTerminal refuse a stale worker).",
    ["kind", "error"],
)
LEASE_ACQUISITIONS = Counter("yuxi_lease_acquisitions", "Leases taken on pending runs (run starts).")
LEASE_RENEWALS = Counter("yuxi_lease_renewals", "Lease renewals by the owning worker.")
LEASE_EXPIRIES = Counter("yuxi_lease_expiries", "Runs failed by the lease sweeper because their lease expired.")
RUNS_RECOVERED = Counter(
    "yuxi_runs_recovered",
    "Runs whose lease expired that the lease sweeper put back to pending for another worker to continue (R-RUN-15).",
)
LEASE_TAKEOVERS = Counter(
    "yuxi_lease_takeovers",
    "Acquisitions of a run that an earlier owner had held (fencing token above 1).",
)
SSE_STREAMS_OPEN = Gauge(
    "yuxi_sse_streams_open",
    "Server-Sent Event streams open now (GET /api/runs/{id}/events).",
    multiprocess_mode="livesum",
)
SSE_STREAMS = Counter("yuxi_sse_streams", "Server-Sent Event streams opened.")
DISPATCHER_REENQUEUES = Counter(
    "yuxi_dispatcher_reenqueues",
    "Runs the dispatcher enqueued again (lost task, stale pending run), by reason.",
    ["reason"],
)
WEBHOOK_ATTEMPTS = Counter(
    "yuxi_webhook_attempts",
    "Webhook delivery attempts (requests sent) by the delivery's status after them: delivered (2xx), retrying, failed (given up).",
    ["status"],
)
WEBHOOK_SKIPPED = Counter(
    "yuxi_webhook_deliveries_skipped",
    "Webhook deliveries skipped without a request: the run's thread deleted, the URL erased or its host no longer allowed.",
)

#: Label used for a model name that is not a configured one.
OTHER = "other"
#: The ``role`` of a model-call row and of a tool row in the rows given to
#: :func:`run_ended` (``Message.Role.ASSISTANT`` / ``Message.Role.TOOL``;
#: a test keeps them equal).
MODEL_ROLE = "assistant"
TOOL_ROLE = "tool"
_LABEL_MAX = 100


def multiprocess_dir() -> str | None:
    """The multiprocess directory, or None in single-process mode."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


# --------------------------------------------------------------------------
# Labels
# --------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _known_models() -> frozenset[str]:
    return frozenset(available_models())


def model_label(name: str | None) -> str:
    """The run's configured model name, or ``other`` for any name that is
    not configured (bounded label cardinality)."""
    return name if name and name in _known_models() else OTHER


def error_type_label(error_type: str | None) -> str:
    """``agent_error:ValueError`` → ``agent_error``: the stable part."""
    return (error_type or "").split(":", 1)[0][:_LABEL_MAX]


def _label(value: str | None) -> str:
    return (value or "")[:_LABEL_MAX]


def _safely[F: Callable[..., Any]](fn: F) -> F:
    """Metrics never fail the caller: errors are logged and swallowed."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not enabled:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception:
            log.exception("metrics: %s failed", fn.__name__)
            return None

    return wrapper  # type: ignore[return-value]


def _after_commit(fn: Callable[[], None]) -> None:
    """Run ``fn`` after the current transaction commits (at once outside
    one); a failure is logged, never raised into the committer."""
    from core.db import on_commit

    on_commit(_safely(fn), robust=True)


# --------------------------------------------------------------------------
# Hooks called by the product (each a one-liner at its call site)
# --------------------------------------------------------------------------


def audit_write[F: Callable[..., Any]](kind: str) -> Callable[[F], F]:
    """Decorate a lease-checked service: each call is observed by
    :func:`audit_write_observed` under ``kind``, a fixed name per service
    (``model_start``, ``tool_finish``, ``lease_renew``, ``run_finish``…)."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with audit_write_observed(kind):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


@contextlib.contextmanager
def audit_write_observed(kind: str) -> Iterator[None]:
    """Observe one audit write of the service ``kind``: its latency
    (seconds) when it ends into ``yuxi_audit_write_duration_seconds{kind}``,
    or, when it raises, its error's class name into
    ``yuxi_audit_write_errors_total{kind, error}`` (then re-raised). A
    write that stops to be made in a thread (``SynchronousOnlyOperation``,
    ``NeedsThread``: it reached the ORM, or no connection was at hand, on
    the event loop's thread) is neither: it is observed where it is made."""
    if not enabled:
        yield
        return
    began = time.perf_counter()
    try:
        yield
    except (SynchronousOnlyOperation, NeedsThread):
        raise
    except Exception as exc:
        _count_write_error(kind, exc)
        raise
    AUDIT_WRITE_DURATION.labels(kind).observe(time.perf_counter() - began)


@_safely
def _count_write_error(kind: str, exc: BaseException) -> None:
    AUDIT_WRITE_ERRORS.labels(kind, type(exc).__name__[:_LABEL_MAX]).inc()


@_safely
def lease_acquired(run) -> None:
    """After commit: one acquisition; a takeover when ``run.fencing_token``
    (already incremented) shows an earlier owner. Call inside the
    acquiring transaction."""
    takeover = run.fencing_token > 1

    def record() -> None:
        LEASE_ACQUISITIONS.inc()
        if takeover:
            LEASE_TAKEOVERS.inc()

    _after_commit(record)


@_safely
def lease_renewed() -> None:
    """After commit: one lease renewal."""
    _after_commit(LEASE_RENEWALS.inc)


@_safely
def lease_expired() -> None:
    """After commit: one run failed by the lease sweeper."""
    _after_commit(LEASE_EXPIRIES.inc)


@_safely
def run_recovered() -> None:
    """After commit: one run put back to pending by the lease sweeper, to be
    continued by another worker (R-RUN-15)."""
    _after_commit(RUNS_RECOVERED.inc)


@_safely
def record_lease_takeover() -> None:
    """For a component that takes a run over from a dead owner by another
    path than :func:`lease_acquired` (after its commit)."""
    LEASE_TAKEOVERS.inc()


@_safely
def webhook_attempted(status: str) -> None:
    """A webhook delivery attempt (a request sent) ended (R-API-3);
    ``status`` is the delivery's after it: ``delivered``, ``retrying`` or
    ``failed`` (given up)."""
    WEBHOOK_ATTEMPTS.labels(_label(status)).inc()


@_safely
def webhook_skipped() -> None:
    """A webhook delivery was skipped without a request (R-API-3)."""
    WEBHOOK_SKIPPED.inc()


@_safely
def record_reenqueue(reason: str = "stale") -> None:
    """The dispatcher enqueued a run again; ``reason`` is a fixed word
    (``stale``, ``lost_task``…), never an id."""
    DISPATCHER_REENQUEUES.labels(_label(reason)).inc()


@_safely
def run_ended(run, *, rows: list[dict[str, Any]]) -> None:
    """Call inside the terminal transaction, with ``run`` already given its
    terminal status, error type and ``finished_at``. After commit, records
    the run end, its duration, and — from its audit rows — its model calls
    (count, duration, tokens, cost) and tool executions (R-OPS-1).

    ``rows``: every audit row of the run as the terminal transaction wrote
    them, so nothing is read after commit. Each a dict with:

    * ``role``: :data:`MODEL_ROLE` for a model call, :data:`TOOL_ROLE` for a
      tool row (a tool row with ``started_at`` None never ran and is not
      counted); rows of any other role are skipped;
    * ``execution_status``, ``started_at``, ``duration_ms`` (None when not
      known), ``usage`` (the provider's usage dict, or None), ``tool_name``;
    * ``cost_usd`` (optional): the model call's cost, None when unknown
      (counted in ``yuxi_model_calls_cost_unknown``); a row without the key
      counts no cost at all."""
    snapshot = {
        "status": run.status,
        "error_type": error_type_label(run.error_type),
        "model": model_label(run.model),
        "started_at": run.started_at,
        "finished_at": run.finished_at,
        "rows": rows,
    }
    _after_commit(lambda: _record_run_end(**snapshot))


def _record_run_end(
    *,
    status: str,
    error_type: str,
    model: str,
    started_at: datetime | None,
    finished_at: datetime | None,
    rows: list[dict[str, Any]],
) -> None:
    RUNS_FINISHED.labels(status, error_type, model).inc()
    if started_at and finished_at:
        RUN_DURATION.labels(model, status).observe(max(0.0, (finished_at - started_at).total_seconds()))
    for row in rows:
        if row["role"] == MODEL_ROLE:
            _record_model_row(model, row)
        elif row["role"] == TOOL_ROLE and row["started_at"] is not None:
            # Message.objects.tool_executions(): a rejected call never started.
            tool = _label(row["tool_name"])
            TOOL_EXECUTIONS.labels(tool, row["execution_status"]).inc()
            if row["duration_ms"] is not None:
                TOOL_DURATION.labels(tool).observe(row["duration_ms"] / 1000)


_TOKEN_KINDS = (
    ("input", ("input_tokens",)),
    ("output", ("output_tokens",)),
    ("cache_read", ("input_token_details", "cache_read")),
    ("cache_creation", ("input_token_details", "cache_creation")),
    ("reasoning", ("output_token_details", "reasoning")),
)


def _record_model_row(model: str, row: dict[str, Any]) -> None:
    MODEL_CALLS.labels(model, row["execution_status"]).inc()
    if row["duration_ms"] is not None:
        MODEL_CALL_DURATION.labels(model).observe(row["duration_ms"] / 1000)
    usage = row["usage"]
    if not isinstance(usage, dict) or not usage:
        MODEL_CALLS_USAGE_UNKNOWN.labels(model).inc()
    else:
        for kind, path in _TOKEN_KINDS:
            value: Any = usage
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            if isinstance(value, int | float) and value > 0:
                MODEL_TOKENS.labels(model, kind).inc(value)
    if "cost_usd" in row:
        if row["cost_usd"] is None:
            MODEL_CALLS_COST_UNKNOWN.labels(model).inc()
        else:
            MODEL_COST.labels(model).inc(float(row["cost_usd"]))


async def track_sse(stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """Wrap an SSE frame iterator: ``yuxi_sse_streams_open`` counts it while
    it is being served, until it ends or the client goes away."""
    counted = enabled
    if counted:
        SSE_STREAMS.inc()
        SSE_STREAMS_OPEN.inc()
    try:
        async for frame in stream:
            yield frame
    finally:
        if counted:
            SSE_STREAMS_OPEN.dec()
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()
