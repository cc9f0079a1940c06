"""A minimal real OTLP/HTTP trace receiver for tests (R-OTEL-1): an HTTP
server on loopback that decodes ``ExportTraceServiceRequest`` protobufs with
``opentelemetry-proto`` and keeps every span it accepted. A script of
answers lets a test make it fail mid-export: ``"ok"`` stores and answers
200, ``"store-503"`` stores the spans but answers 503 (the receiver took
them, the exporter does not know), ``"503"`` answers 503 without storing, ``"302"`` and ``"307"`` answer a
redirect without storing (and without a ``Location``: nothing to follow).
:meth:`OtlpReceiver.stop` closes the socket (a dead receiver).

With ``upstream`` (a real receiver's base URL, e.g. Phoenix) it is a proxy
instead: "stores" means "forwards to the upstream", and ``"ok"`` answers
with the upstream's status."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    status_code: int
    status_message: str
    attributes: dict
    links: list[tuple[str, str, dict]]


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


class OtlpReceiver:
    def __init__(self, upstream: str | None = None) -> None:
        self.upstream = upstream
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self.script: list[str] = []
        self.default = "ok"
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver._lock:
                    receiver.requests += 1
                    answer = receiver.script.pop(0) if receiver.script else receiver.default
                    if self.path != "/v1/traces":
                        answer = "404"
                    status = {"ok": 200, "store-503": 503, "503": 503, "404": 404, "302": 302, "307": 307}[answer]
                    if answer in ("ok", "store-503"):
                        upstream_status = receiver._store(body)
                        if answer == "ok":
                            status = upstream_status
                payload = ExportTraceServiceResponse().SerializeToString() if status == 200 else b"unavailable"
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self._handler = Handler
        self.port = 0
        self._serve()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True, name="otlp-receiver").start()

    def restart(self) -> None:
        """Listen again on the same port, keeping what was received."""
        self._serve()

    def _store(self, body: bytes) -> int:
        if self.upstream:
            return httpx.post(
                f"{self.upstream}/v1/traces", content=body, headers={"Content-Type": "application/x-protobuf"}
            ).status_code
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        ReceivedSpan(
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            name=span.name,
                            kind=span.kind,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            status_code=span.status.code,
                            status_message=span.status.message,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            links=[
                                (
                                    link.trace_id.hex(),
                                    link.span_id.hex(),
                                    {a.key: _value(a.value) for a in link.attributes},
                                )
                                for link in span.links
                            ],
                        )
                    )
        return 200

    def unique(self) -> dict[str, ReceivedSpan]:
        """Spans by span id, as a receiver that keeps one span per id does."""
        return {span.span_id: span for span in self.spans}

    def duplicates(self) -> Counter:
        return Counter(span.span_id for span in self.spans)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
