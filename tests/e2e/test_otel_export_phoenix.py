"""The OpenTelemetry export proven against Arize Phoenix (R-OTEL-1): real
runs made over HTTP by the stack's processes, ``manage.py export_otel
--once`` as its own process, spans read back from Phoenix with
``arize-phoenix-client`` and checked against the database; then a receiver
that fails mid-export loses and duplicates nothing.

One Phoenix per module; its start-up time is printed (``-s``) and logged in
``test-artifacts/phoenix.log``. The same assertions run against a minimal
OTLP receiver in ``tests/otel/test_export.py``."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest

from audit.execution.runner import run_execute
from audit.models import AgentRun
from conversations.models import Conversation, Message
from otel_export.models import ExportCursor
from otel_export.spans import row_span_id, run_span_id
from tests.conftest import bearer, make_run
from tests.otel.receiver import OtlpReceiver

from .stack import REPO, create_thread, start_stack, wait_for_status

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.otel_receiver,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(900),
]

TERMINAL = {"completed", "failed", "cancelled", "interrupted"}
KIND = {"invoke_agent": "AGENT", "chat": "LLM", "execute_tool": "TOOL"}


@pytest.fixture(scope="module")
def stack(e2e_database_url):
    """This module's own processes, with a lease long enough that a busy
    machine (Phoenix ingesting next to them) never expires one: the runs
    here must end as their scenarios say."""
    from django.conf import settings

    stack = start_stack(database_url=e2e_database_url, redis_url=settings.CONFIG.REDIS_URL, lease_ttl=30.0)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory):
    try:
        import phoenix.server.main  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"arize-phoenix is not installed ({exc}); tests/otel/test_export.py covers the export")
    from tests.otel.phoenix import start_phoenix

    server = start_phoenix(tmp_path_factory.mktemp("phoenix"))
    print(f"\nPhoenix answered after {server.startup_seconds:.1f} s")
    yield server
    server.process.stop()


def export_once(env: dict[str, str], endpoint: str, **extra: str) -> subprocess.CompletedProcess:
    """``manage.py export_otel --once`` as its own process."""
    return subprocess.run(
        [sys.executable, "manage.py", "export_otel", "--once"],
        cwd=REPO,
        env={**env, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORT_SETTLE_SECONDS": "0", **extra},
        capture_output=True,
        text=True,
        timeout=300,
    )


def submit(client, thread_id: str, text: str) -> str:
    response = client.post(
        f"/api/threads/{thread_id}/runs", json={"request_id": f"o-{uuid.uuid4().hex}", "input": {"text": text}}
    )
    assert response.status_code == 202, response.text
    return response.json()["run_id"]


def attribute(span: dict, dotted: str):
    """An attribute of a span read from Phoenix, flat or nested."""
    attributes = span.get("attributes") or {}
    if dotted in attributes:
        return attributes[dotted]
    value = attributes
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def test_export_otel_shows_every_run_in_phoenix_with_nesting_tokens_and_status_R_OTEL_1(stack, phoenix, user):
    with stack.client(bearer(user)) as client:
        tool_run = submit(client, create_thread(client, "replay:tool_then_answer"), "Weather in Paris?")
        approval_thread = create_thread(client, "replay:approval_send_email")
        interrupted = submit(client, approval_thread, "Mail Bob")
        failed = submit(client, create_thread(client, "replay:model_http_error"), "fail please")
        cancelled = submit(client, create_thread(client, "replay:slow_answer"), "talk slowly")
        assert wait_for_status(client, tool_run, TERMINAL)["status"] == "completed"
        assert wait_for_status(client, interrupted, TERMINAL)["status"] == "interrupted"
        resumed = client.post(
            f"/api/runs/{interrupted}/resume",
            json={"request_id": f"r-{uuid.uuid4().hex}", "decisions": [{"type": "approve"}]},
        )
        assert resumed.status_code == 202, resumed.text
        resume = resumed.json()["run_id"]
        wait_for_status(client, cancelled, {"running"})
        while not Message.objects.model_calls().filter(run_id=cancelled).exists():
            time.sleep(0.05)
        assert client.post(f"/api/runs/{cancelled}/cancel").status_code == 202
        assert wait_for_status(client, resume, TERMINAL)["status"] == "completed"
        assert wait_for_status(client, failed, TERMINAL)["status"] == "failed"
        assert wait_for_status(client, cancelled, TERMINAL)["status"] == "cancelled"

    done = export_once(stack.env, phoenix.base_url)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done: 5 runs" in done.stdout, done.stdout

    runs = list(AgentRun.objects.filter(pk__in=[tool_run, interrupted, resume, failed, cancelled]))
    rows = list(Message.objects.audit().filter(run__in=runs))
    spans = phoenix.spans([run.id.hex for run in runs], expect=len(runs) + len(rows))
    by_id = {span["context"]["span_id"]: span for span in spans}
    assert len(spans) == len(by_id) == len(runs) + len(rows)

    for run in runs:
        root = by_id[f"{run_span_id(run.id):016x}"]
        assert root["context"]["trace_id"] == run.id.hex
        assert not root.get("parent_id")
        assert root["name"] == "invoke_agent assistant" and root["span_kind"] == KIND["invoke_agent"]
        assert root["status_code"] == ("ERROR" if run.status in ("failed", "cancelled") else "OK")
        assert attribute(root, "yuxi.run.status") == run.status
        assert attribute(root, "session.id") == str(run.thread_id)  # from gen_ai.conversation.id
        usage = run.usage or {}
        assert (attribute(root, "llm.token_count.prompt") or 0) == usage.get("input_tokens", 0)
        assert (attribute(root, "llm.token_count.completion") or 0) == usage.get("output_tokens", 0)
    for row in rows:
        span = by_id[f"{row_span_id(row.pk):016x}"]
        assert span["context"]["trace_id"] == row.run_id.hex
        assert span["parent_id"] == f"{run_span_id(row.run_id):016x}"
        operation = "execute_tool" if row.role == Message.Role.TOOL else "chat"
        assert span["name"].startswith(operation + " ") and span["span_kind"] == KIND[operation]
        assert attribute(span, "yuxi.sequence") == row.sequence
        assert attribute(span, "yuxi.operation_id") == row.operation_id
        assert span["status_code"] == {"completed": "OK", "interrupted": "UNSET"}.get(row.execution_status, "ERROR")
        if operation == "chat" and row.usage:
            assert attribute(span, "llm.token_count.prompt") == row.usage["input_tokens"]
            assert attribute(span, "llm.token_count.completion") == row.usage["output_tokens"]
        if operation == "execute_tool":
            assert attribute(span, "tool.name") == row.tool_name
    # The kinds of rows the runs had, so each kind of span was checked.
    assert {(r.run_id, r.role) for r in rows} >= {
        (AgentRun.objects.get(pk=tool_run).pk, "tool"),
        (AgentRun.objects.get(pk=resume).pk, "tool"),
        (AgentRun.objects.get(pk=cancelled).pk, "assistant"),
    }

    again = export_once(stack.env, phoenix.base_url)
    assert again.returncode == 0 and "nothing new to export" in again.stdout, again.stdout + again.stderr
    assert len(phoenix.spans([run.id.hex for run in runs], expect=len(spans) + 1, timeout=3)) == len(spans)


def test_receiver_failing_mid_export_loses_and_duplicates_nothing_in_phoenix_R_OTEL_1(
    stack, phoenix, user, replay_models
):
    runs = []
    for i in range(4):
        thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:tool_then_answer")
        run = make_run(thread, text=f"Weather {i}?")
        assert run_execute(run_id=run.id, owner="in-process") == "completed"
        runs.append(run)
    expected = {f"{run_span_id(run.id):016x}" for run in runs} | {
        f"{row_span_id(pk):016x}" for pk in Message.objects.audit().filter(run__in=runs).values_list("pk", flat=True)
    }
    assert len(expected) == 16

    # In front of Phoenix: two requests pass, the third reaches Phoenix but
    # its answer is lost (503), then the receiver is down.
    proxy = OtlpReceiver(upstream=phoenix.base_url)
    proxy.script = ["ok", "ok", "store-503"]
    proxy.default = "503"
    try:
        env = {"OTEL_EXPORT_BATCH_SPANS": "3", "OTEL_EXPORTER_OTLP_TIMEOUT": "1"}
        first = export_once(stack.env, proxy.endpoint, **env)
        assert first.returncode == 1 and "nothing lost" in first.stderr, first.stdout + first.stderr
        proxy.stop()
        down = export_once(stack.env, proxy.endpoint, **env)
        assert down.returncode == 1 and "no answer" in down.stderr, down.stdout + down.stderr
        cursor = ExportCursor.objects.get()
        assert cursor.exported_runs == 1  # run 1's spans went in requests 1 and 2

        proxy.restart()
        proxy.default = "ok"
        last = export_once(stack.env, proxy.endpoint, **env)
        assert last.returncode == 0, last.stdout + last.stderr
        assert "done: 3 runs" in last.stdout
    finally:
        proxy.stop()
    # Spans of request 3 were sent twice; Phoenix holds every span once.
    spans = phoenix.spans([run.id.hex for run in runs], expect=len(expected))
    assert sorted(span["context"]["span_id"] for span in spans) == sorted(expected)
    assert ExportCursor.objects.get().exported_runs == 4
    again = export_once(stack.env, phoenix.base_url)
    assert again.returncode == 0 and "nothing new to export" in again.stdout
