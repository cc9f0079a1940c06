"""The OpenTelemetry export against the same work done without the product
(``python manage.py bench_otel_export``, R-OTEL-1, issue 38).

Drives runs through the real services (lease, model and tool rows closed
by their lifecycles, ``run_finish``), then, in alternating rounds:

* the product: one export pass (:func:`otel_export.services.export_closed_runs`)
  from a cursor of its own placed just before the benchmark's runs — the
  horizon, the cursor's compare-and-set, the span factory, the SDK's
  OTLP/HTTP exporter;
* the baseline: the same runs and rows read with psycopg, one statement for
  a page of runs and one for their rows, spans of the same names, parents,
  timestamps, attributes (without content) and links made by a bare SDK
  tracer (random ids, no text escaping), sent in requests of the same size
  by the same SDK exporter.

The baseline carries no message content: with ``OTEL_EXPORT_CONTENT`` on
the product does more (its command says so), and the target (≥ 0.5x) is
for content off, the default. Both send to one in-process OTLP/HTTP receiver that answers 200 without
decoding. The figure is spans per second of each (spans sent / wall time of
the pass). A benchmark, not a test: it prints figures and asserts nothing.
Creates a throw-away user, threads and runs and deletes them at the end.
"""

from __future__ import annotations

import datetime as dt
import statistics
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psycopg
from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone
from opentelemetry import trace as trace_api
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import SpanKind

from audit import ledger
from audit.models import AgentRun
from conversations.models import Conversation
from core.config import get_config
from otel_export.models import ExportCursor
from otel_export.services import RUN_PAGE, OtlpReceiver, export_closed_runs
from yuxi_project.runtime import tune_gc

from .databases import throwaway_user_delete
from .seal import _driven_run


@dataclass(frozen=True)
class OtelExportBench:
    runs: int
    rows_per_run: int
    spans_per_pass: int
    product_spans_per_s: list[float]
    baseline_spans_per_s: list[float]

    @property
    def product_median(self) -> float:
        return statistics.median(self.product_spans_per_s)

    @property
    def baseline_median(self) -> float:
        return statistics.median(self.baseline_spans_per_s)

    @property
    def ratio_median(self) -> float:
        return self.product_median / self.baseline_median


class _Receiver:
    """An OTLP/HTTP receiver on loopback that accepts every request (200,
    an empty ``ExportTraceServiceResponse``) without decoding it."""

    def __init__(self) -> None:
        answer = ExportTraceServiceResponse().SerializeToString()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True, name="bench-otlp-receiver").start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# --------------------------------------------------------------------------
# Baseline: psycopg, one statement per page, a bare SDK tracer
# --------------------------------------------------------------------------

_RUNS_SQL = """
SELECT id, agent_id, model, thread_id, turn_id, status, usage, started_at, created_at, finished_at
FROM audit_agentrun WHERE id = ANY(%s) ORDER BY finished_at, id
"""
_ROWS_SQL = """
SELECT m.id, m.run_id, m.role, m.operation_id, m.sequence, m.execution_status, m.tool_name,
       m.started_at, m.created_at, m.finished_at, m.usage, m.cost_usd, m.metadata, m.declared_by_id, d.run_id
FROM conversations_message m LEFT JOIN conversations_message d ON d.id = m.declared_by_id
WHERE m.run_id = ANY(%s) AND m.operation_id IS NOT NULL
ORDER BY m.run_id, m.sequence NULLS LAST, m.id
"""


class _Collect(SpanProcessor):
    def __init__(self) -> None:
        self.finished: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.finished.append(span)


def _ns(moment: dt.datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp() * 1_000_000) * 1_000


def _usage(usage: dict | None) -> dict:
    usage = usage or {}
    return {
        f"gen_ai.usage.{key}": int(usage[key])
        for key in ("input_tokens", "output_tokens")
        if isinstance(usage.get(key), int | float)
    }


def _baseline_pass(run_ids: list[uuid.UUID], *, endpoint: str, batch_spans: int) -> int:
    """Read ``run_ids`` and their audit rows with psycopg, make their spans
    with a bare SDK tracer and send them; returns the spans sent."""
    settings = connection.settings_dict
    collect = _Collect()
    provider = TracerProvider(resource=Resource.create({"service.name": "bench"}), sampler=ALWAYS_ON)
    provider.add_span_processor(collect)
    tracer = provider.get_tracer("bench")
    exporter = OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces", timeout=10)
    sent = 0
    with psycopg.connect(
        host=settings["HOST"] or "127.0.0.1",
        port=settings["PORT"] or 5432,
        user=settings["USER"],
        password=settings["PASSWORD"] or None,
        dbname=settings["NAME"],
        autocommit=True,
    ) as conn:
        for start in range(0, len(run_ids), RUN_PAGE):
            runs = conn.execute(_RUNS_SQL, [run_ids[start : start + RUN_PAGE]]).fetchall()
            rows: dict[uuid.UUID, list[tuple]] = {}
            for row in conn.execute(_ROWS_SQL, [[run[0] for run in runs]]):
                rows.setdefault(row[1], []).append(row)
            for run_id, agent_id, model, thread_id, turn_id, status, usage, started, created, finished in runs:
                provider, _, model_name = model.partition(":")
                common = {
                    "gen_ai.conversation.id": str(thread_id),
                    "yuxi.run_id": str(run_id),
                    "yuxi.thread_id": str(thread_id),
                }
                run_start = _ns(started or created)
                root = tracer.start_span(
                    f"invoke_agent {agent_id}",
                    kind=SpanKind.INTERNAL,
                    attributes={
                        "gen_ai.operation.name": "invoke_agent",
                        "gen_ai.agent.name": agent_id,
                        "gen_ai.provider.name": provider,
                        "gen_ai.request.model": model_name,
                        "yuxi.turn_id": str(turn_id),
                        "yuxi.run.status": status,
                        **common,
                        **_usage(usage),
                    },
                    start_time=run_start,
                )
                context = trace_api.set_span_in_context(root)
                for (
                    pk,
                    _run,
                    role,
                    operation_id,
                    sequence,
                    execution,
                    tool,
                    r_started,
                    r_created,
                    r_finished,
                    r_usage,
                    cost,
                    metadata,
                    declared_by,
                    declared_by_run,
                ) in rows.get(run_id, []):
                    attributes = {
                        **common,
                        "yuxi.operation_id": operation_id,
                        "yuxi.row_id": pk,
                        "yuxi.sequence": sequence,
                        "yuxi.execution_status": execution or "",
                    }
                    links = []
                    if role == "tool":
                        name = f"execute_tool {tool}"
                        attributes["gen_ai.operation.name"] = "execute_tool"
                        attributes["gen_ai.tool.name"] = tool
                        attributes["gen_ai.tool.call.id"] = operation_id
                        attributes["gen_ai.tool.type"] = "function"
                        if declared_by and declared_by_run:
                            links.append(
                                trace_api.Link(
                                    trace_api.SpanContext(declared_by_run.int, declared_by, is_remote=True),
                                    {"yuxi.link": "declared_by"},
                                )
                            )
                    else:
                        name = f"chat {model_name}"
                        attributes["gen_ai.operation.name"] = "chat"
                        attributes["gen_ai.provider.name"] = provider
                        attributes["gen_ai.request.model"] = model_name
                        if (metadata or {}).get("response_id"):
                            attributes["gen_ai.response.id"] = str(metadata["response_id"])
                        attributes.update(_usage(r_usage))
                    if cost is not None:
                        attributes["yuxi.cost_usd"] = float(cost)
                    row_start = _ns(r_started or r_created)
                    span = tracer.start_span(
                        name, context=context, attributes=attributes, links=links, start_time=row_start
                    )
                    span.end(end_time=max(_ns(r_finished) or row_start, row_start))
                root.end(end_time=max(_ns(finished) or run_start, run_start))
                if len(collect.finished) >= batch_spans:
                    exporter.export(collect.finished)
                    sent += len(collect.finished)
                    collect.finished = []
        if collect.finished:
            exporter.export(collect.finished)
            sent += len(collect.finished)
            collect.finished = []
    exporter.shutdown()
    return sent


# --------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------


def bench_otel_export(*, runs: int = 60, rows: int = 10, rounds: int = 3, log=lambda _line: None) -> OtelExportBench:
    """Spans per second of the product's export pass and of the baseline
    over ``runs`` runs of ``rows`` audit rows each, ``rounds`` times each,
    alternating. Exports with the configured ``OTEL_EXPORT_CONTENT``,
    ``OTEL_EXPORT_BATCH_SPANS`` and ``OTEL_EXPORT_MAX_PAYLOAD_CHARS``, no
    settle time (the runs are committed before the passes begin)."""
    config = get_config()
    first_day = timezone.now().astimezone(dt.UTC).date()
    user = get_user_model().objects.create_user(username=f"bench-otel-{uuid.uuid4().hex[:10]}")
    receiver = _Receiver()
    settle = config.OTEL_EXPORT_SETTLE_SECONDS
    cursor_names: list[str] = []
    product, baseline = [], []
    try:
        log(f"driving {runs} runs of {rows} audit rows ...")
        made = []
        for _ in range(runs):
            thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
            run, lease, state = _driven_run(user, thread, rows)
            ledger.run_finish(lease=lease, status="completed", final_state=state)
            made.append(run.pk)
        finished = list(AgentRun.objects.filter(pk__in=made).order_by("finished_at", "id"))
        run_ids = [run.id for run in finished]
        before = finished[0].finished_at - dt.timedelta(microseconds=1)
        config.OTEL_EXPORT_SETTLE_SECONDS = 0.0
        spans = 0
        # As the worker (the beat task's export) and the export_otel loop
        # are: the loaded code out of the collector's way.
        tune_gc()
        for round_ in range(rounds):
            name = f"bench-{uuid.uuid4().hex[:12]}"
            cursor_names.append(name)
            ExportCursor.objects.create(name=name, finished_at=before, run_id=uuid.UUID(int=0))
            exporter = OtlpReceiver(endpoint=receiver.endpoint, timeout=10)
            started = time.perf_counter()
            result = export_closed_runs(receiver=exporter, cursor_name=name)
            elapsed = time.perf_counter() - started
            exporter.close()
            if result.error or result.runs < runs:
                log(f"product pass: {result.runs} of {runs} runs ({result.error or result.waiting_for})")
            spans = result.spans
            product.append(result.spans / elapsed)

            started = time.perf_counter()
            sent = _baseline_pass(run_ids, endpoint=receiver.endpoint, batch_spans=config.OTEL_EXPORT_BATCH_SPANS)
            baseline.append(sent / (time.perf_counter() - started))
            log(f"round {round_ + 1}: product {product[-1]:.0f} spans/s, baseline {baseline[-1]:.0f} spans/s")
    finally:
        config.OTEL_EXPORT_SETTLE_SECONDS = settle
        receiver.stop()
        ExportCursor.objects.filter(name__in=cursor_names).delete()
        throwaway_user_delete(user, bench="bench_otel_export", since=first_day)
    return OtelExportBench(
        runs=runs,
        rows_per_run=rows,
        spans_per_pass=spans,
        product_spans_per_s=product,
        baseline_spans_per_s=baseline,
    )
