"""Every fact exact, end to end (issue findings 3–5): per-execution
workspace files (R-TA-7), large results projected in history (R-READ-7),
idempotency keys per user shared by submit and resume, also under
concurrent retries (R-IDEM-1).

Real processes (uvicorn, a Celery worker, the replay model server) on the
test database; the tests drive HTTP and read the database, the workspace
and the LangGraph checkpoint."""

from __future__ import annotations

import json
import re
import threading
import uuid
from pathlib import Path

import pytest

from audit.models import AgentRun
from conversations.models import Conversation, Message
from core.workspace import large_result_path, outbox_path
from tests.conftest import bearer

from .stack import TERMINAL_STATUSES as TERMINAL
from .stack import create_thread, wait_for_status
from .test_tool_audit import _checkpoint_messages

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

_PATH = re.compile(r"saved to the workspace file (\S+)\. Preview")


def _submit(client, thread_id: str, text: str, request_id: str | None = None):
    return client.post(
        f"/api/threads/{thread_id}/runs",
        json={"request_id": request_id or f"req-{uuid.uuid4().hex}", "input": {"text": text}},
    )


def _turn(client, thread_id: str, text: str) -> dict:
    submitted = _submit(client, thread_id, text)
    assert submitted.status_code == 202, submitted.text
    return wait_for_status(client, submitted.json()["run_id"], TERMINAL)


def _resume(client, run_id: str, request_id: str, decisions=({"type": "approve"},)):
    return client.post(f"/api/runs/{run_id}/resume", json={"request_id": request_id, "decisions": list(decisions)})


def _play(thread_id: str, scenario: str) -> None:
    """The replay server plays a scenario from its first turn for every
    user message, so a thread switches scenario between its runs."""
    Conversation.objects.filter(pk=thread_id).update(model=f"replay:{scenario}")


def test_a_tool_call_id_reused_by_a_later_run_keeps_each_runs_file_R_TA_7(stack, user):
    with stack.client(bearer(user)) as client:
        thread_id = create_thread(client, "replay:reused_call_id_lookup_alpha")
        run_a = _turn(client, thread_id, "look up alpha")
        _play(thread_id, "reused_call_id_lookup_beta")
        run_b = _turn(client, thread_id, "look up beta")
        assert (run_a["status"], run_b["status"]) == ("completed", "completed")
        history = client.get(f"/api/threads/{thread_id}/history").json()
        memory = client.get(f"/api/threads/{thread_id}/memory?include_tools=true").json()

    workspace = Path(stack.env["WORKSPACE_ROOT"]) / thread_id
    tool_messages = [m for m in _checkpoint_messages(thread_id) if m.type == "tool"]
    assert [m.tool_call_id for m in tool_messages] == ["call_0", "call_0"]
    for message, run, query in zip(tool_messages, (run_a, run_b), ("alpha", "beta"), strict=True):
        path = _PATH.search(message.content).group(1)
        assert path == large_result_path(run_id=run["run_id"], tool_call_id="call_0").as_posix()
        stored = (workspace / path).read_text()
        assert stored.startswith(f"Results for '{query}'") and len(stored) == 5000
        row = Message.objects.get(run_id=run["run_id"], role=Message.Role.TOOL)
        assert row.content == stored
    executions = [t for item in history["items"] for t in item["tool_executions"]]
    assert [t["content"] for t in executions] == [m.content for m in tool_messages]
    assert [m["content"] for m in memory["messages"] if m["type"] == "tool"] == [m.content for m in tool_messages]


def test_two_approved_emails_with_one_call_id_leave_two_outbox_records_R_TA_7(stack, user):
    resumes = []
    with stack.client(bearer(user)) as client:
        thread_id = create_thread(client, "replay:reused_call_id_email_alpha")
        for query in ("alpha", "beta"):
            _play(thread_id, f"reused_call_id_email_{query}")
            interrupted = _turn(client, thread_id, f"email {query}")
            assert interrupted["status"] == "interrupted", interrupted
            resumed = _resume(client, interrupted["run_id"], f"approve-{query}")
            assert resumed.status_code == 202, resumed.text
            done = wait_for_status(client, resumed.json()["run_id"], TERMINAL)
            assert done["status"] == "completed", done
            resumes.append(done["run_id"])
    workspace = Path(stack.env["WORKSPACE_ROOT"]) / thread_id
    assert len(list((workspace / "outbox").rglob("*.json"))) == 2
    for run_id, query in zip(resumes, ("alpha", "beta"), strict=True):
        record = json.loads((workspace / outbox_path(run_id=run_id, tool_call_id="call_0")).read_text())
        assert record["to"] == f"{query}@example.com"


def test_history_of_a_million_character_result_stays_small_R_READ_7(stack, user, staff_user):
    with stack.client(bearer(user)) as client:
        thread_id = create_thread(client, "replay:huge_lookup")
        done = _turn(client, thread_id, "everything please")
        assert done["status"] == "completed", done
        history = client.get(f"/api/threads/{thread_id}/history")
        memory = client.get(f"/api/threads/{thread_id}/memory?include_tools=true").json()
    assert history.status_code == 200 and len(history.content) < 10_000, len(history.content)
    (execution,) = [t for item in history.json()["items"] for t in item["tool_executions"]]
    assert execution["size_chars"] == 1_000_000
    path = large_result_path(run_id=done["run_id"], tool_call_id="call_lookup_huge").as_posix()
    assert execution["workspace_path"] == path and path in execution["content"]
    assert execution["content"] == next(m["content"] for m in memory["messages"] if m["type"] == "tool")
    with stack.client(bearer(staff_user)) as staff:
        timeline = staff.get(f"/api/audit/runs/{done['run_id']}/timeline").json()
    (tool,) = [item for item in timeline["items"] if item["kind"] == "tool"]
    assert len(tool["content"]) == 1_000_000 and tool["workspace_path"] == path


def _together(calls):
    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)

    def worker(index, call):
        try:
            barrier.wait(timeout=10)
            results[index] = call()
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[index] = exc

    threads = [threading.Thread(target=worker, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def test_idempotency_keys_per_user_over_http_also_at_the_same_moment_R_IDEM_1(stack, user, other_user):
    headers = bearer(user)
    with stack.client(headers) as client:
        approval = create_thread(client, "replay:approval_send_email")
        interrupted = _turn(client, approval, "send the report")
        assert interrupted["status"] == "interrupted", interrupted

        # Two identical resumes at the same moment (a client retry): one run, 202 + 200.
        def resume():
            with stack.client(headers) as c:
                return _resume(c, interrupted["run_id"], "resume-key")

        responses = _together([resume, resume])
        assert sorted(r.status_code for r in responses) == [200, 202], [r.text for r in responses]
        assert len({r.json()["run_id"] for r in responses}) == 1
        resume_id = responses[0].json()["run_id"]
        assert wait_for_status(client, resume_id, TERMINAL)["status"] == "completed"

        # The resume's key sent as a turn: 409, the text is not dropped silently into the resume run.
        refused = _submit(client, approval, "a new question", request_id="resume-key")
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "request_id_reused"
        assert not Message.objects.filter(content="a new question").exists()

        # Identical and conflicting turns at the same moment.
        plain = create_thread(client, "replay:plain_answer")

        def turn(text, thread=plain):
            def call():
                with stack.client(headers) as c:
                    return (thread, text), _submit(c, thread, text, request_id="turn-key")

            return call

        tagged = _together([turn("hi"), turn("hi"), turn("other"), turn("hi", approval)])
        winners = [(request, r) for request, r in tagged if r.status_code == 202]
        assert len(winners) == 1, [r.text for _, r in tagged]
        (won, first), *_ = winners
        for request, response in tagged:
            if response is first:
                continue
            if request == won:
                assert response.status_code == 200 and response.json()["run_id"] == first.json()["run_id"]
            else:
                assert response.status_code == 409, response.text
                assert response.json()["error"]["code"] == "request_id_reused"
        assert AgentRun.objects.filter(user=user, request_id="turn-key").count() == 1
        # Let the worker finish before the test's database is flushed: a
        # flush that meets a worker's open transaction fails the teardown.
        wait_for_status(client, first.json()["run_id"], TERMINAL)

    # Another user's equal key is independent.
    with stack.client(bearer(other_user)) as stranger:
        own = create_thread(stranger, "replay:plain_answer")
        mine = _submit(stranger, own, "mine", request_id="turn-key")
        assert mine.status_code == 202
        wait_for_status(stranger, mine.json()["run_id"], TERMINAL)
