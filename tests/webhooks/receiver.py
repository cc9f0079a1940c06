"""A real HTTP webhook receiver for tests (R-API-3): a server on loopback
that keeps every request it got (path, headers, body) and answers from a
script: ``"ok"`` 200, ``"500"``, ``"302"`` (a redirect to ``/elsewhere``),
``"slow"`` (answers 200 after ``slow_seconds``). :meth:`stop` closes the
socket: a receiver that is down."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


class WebhookReceiver:
    def __init__(self, port: int = 0) -> None:
        self.received: list[Received] = []
        self.script: list[str] = []
        self.default = "ok"
        self.slow_seconds = 2.0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver._lock:
                    receiver.received.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                    answer = receiver.script.pop(0) if receiver.script else receiver.default
                if answer == "slow":
                    time.sleep(receiver.slow_seconds)
                status = {"ok": 200, "slow": 200, "500": 500, "302": 302}[answer]
                self.send_response(status)
                if status == 302:
                    self.send_header("Location", "/elsewhere")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hooks/runs"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
