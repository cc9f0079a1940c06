"""Arize Phoenix as a real OTLP receiver for the export tests (R-OTEL-1):
its own process, a temporary working directory with SQLite storage, free
loopback ports, no telemetry and no outbound requests. Its log is
``test-artifacts/phoenix.log``."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.e2e.stack import Process, free_port, start


@dataclass
class Phoenix:
    process: Process
    base_url: str
    startup_seconds: float

    def spans(self, trace_ids: list[str], *, expect: int, timeout: float = 60.0) -> list[dict]:
        """The spans of ``trace_ids`` read back with ``arize-phoenix-client``,
        once Phoenix has stored at least ``expect`` (it ingests in the
        background after answering the export)."""
        from phoenix.client import Client

        client = Client(base_url=self.base_url)
        deadline = time.monotonic() + timeout
        while True:
            spans = client.spans.get_spans(project_identifier="default", trace_ids=trace_ids, limit=10_000)
            if len(spans) >= expect or time.monotonic() > deadline:
                return spans
            time.sleep(0.25)


def start_phoenix(working_dir: Path, timeout: float = 400.0) -> Phoenix:
    """Start ``phoenix serve`` and wait until it answers ``/healthz``."""
    port, grpc_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PHOENIX_"))}
    env.update(
        {
            "PHOENIX_WORKING_DIR": str(working_dir),
            "PHOENIX_SQL_DATABASE_URL": f"sqlite:///{working_dir / 'phoenix.db'}",
            "PHOENIX_HOST": "127.0.0.1",
            "PHOENIX_PORT": str(port),
            "PHOENIX_GRPC_PORT": str(grpc_port),
            "PHOENIX_TELEMETRY_ENABLED": "false",
            "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
            "PHOENIX_DISABLE_AGENT_ASSISTANT": "true",
            "PHOENIX_AGENTS_DISABLE_WEB_ACCESS": "true",
            "PHOENIX_AGENTS_DISABLE_BASH": "true",
            "HOME": str(working_dir),
            "PYTHONUNBUFFERED": "1",
            "PYTHONWARNINGS": "ignore",
        }
    )
    started = time.monotonic()
    process = start("phoenix", [sys.executable, "-m", "phoenix.server.main", "serve"], env)
    base_url = f"http://127.0.0.1:{port}"
    deadline = started + timeout
    while True:
        if process.popen.poll() is not None:
            raise RuntimeError(f"Phoenix exited ({process.popen.returncode}):\n{process.output()[-4000:]}")
        try:
            if httpx.get(f"{base_url}/healthz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.stop()
            raise TimeoutError(f"Phoenix did not answer in {timeout}s:\n{process.output()[-4000:]}")
        time.sleep(0.5)
    return Phoenix(process=process, base_url=base_url, startup_seconds=time.monotonic() - started)
