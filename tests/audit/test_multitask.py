"""Double texting (R-API-2): a turn submitted while the thread's earlier
run is pending or running is queued after it (``enqueue``, the default),
refused (``reject``: 409 ``thread_busy``, nothing created), or the earlier
run is cancelled and the new turn runs next (``interrupt``: the earlier run
``cancelled``, its open rows ``interrupted``)."""

from __future__ import annotations

import contextlib
import json
import uuid

import pytest
from django.db import connection
from django.db.backends.signals import connection_created
from django.test import Client

from audit.execution.runner import run_execute, run_execute_acquired
from audit.ledger.runs import run_acquire_with_row
from audit.models import AgentRun, RunCancelRequest, RunRollback
from conversations.models import Conversation, Message
from tests.conftest import bearer, make_run, run_answering, sent_requests
from tests.waiting import WAIT_SECONDS

pytestmark = pytest.mark.django_db(transaction=True)


def submit(thread, text: str, strategy: str | None = None, *, request_id: str | None = None):
    body: dict = {"request_id": request_id or uuid.uuid4().hex, "input": {"text": text}}
    if strategy is not None:
        body["multitask_strategy"] = strategy
    return Client().post(
        f"/api/threads/{thread.id}/runs", json.dumps(body), content_type="application/json", headers=bearer(thread.user)
    )


def test_enqueue_is_the_default_and_queues_the_turn_after_the_running_one_R_API_2(thread):
    first = make_run(thread, text="first")
    for strategy in (None, "enqueue"):
        response = submit(thread, f"then {strategy}", strategy)
        assert response.status_code == 202, response.content
        assert response.json()["status"] == "pending"
    assert AgentRun.objects.get(pk=first.pk).status == "pending"
    assert not RunCancelRequest.objects.exists()


def test_reject_refuses_a_turn_while_a_run_is_pending_and_creates_nothing_R_API_2(thread):
    first = make_run(thread, text="first")
    request_id = uuid.uuid4().hex
    response = submit(thread, "second", "reject", request_id=request_id)
    assert response.status_code == 409, response.content
    error = response.json()["error"]
    assert error["code"] == "thread_busy" and error["runs"] == [str(first.id)]
    # It names every way through: the strategies that do not refuse.
    assert all(strategy in error["message"] for strategy in ("enqueue", "interrupt", "rollback"))
    assert list(AgentRun.objects.values_list("pk", flat=True)) == [first.pk]
    assert list(Message.objects.filter(thread=thread).values_list("content", flat=True)) == ["first"]
    assert AgentRun.objects.get(pk=first.pk).status == "pending"
    # Once the thread is free the same request goes through (its key was not used).
    AgentRun.objects.filter(pk=first.pk).update(status="cancelled")
    response = submit(thread, "second", "reject", request_id=request_id)
    assert response.status_code == 202, response.content


def test_interrupt_cancels_a_pending_run_and_the_new_turn_runs_R_API_2_R_RUN_6(thread, replay_models):
    Conversation.objects.filter(pk=thread.pk).update(model="replay:plain_answer")
    thread.refresh_from_db()
    first = make_run(thread, text="first")
    response = submit(thread, "second, instead", "interrupt")
    assert response.status_code == 202, response.content
    assert AgentRun.objects.get(pk=first.pk).status == "cancelled"
    assert RunCancelRequest.objects.get(run_id=first.pk).applied_at is not None
    second = AgentRun.objects.get(pk=response.json()["run_id"])
    assert run_execute(run_id=second.id, owner="in-process") == "completed"


def test_interrupt_stops_a_running_run_at_its_next_event_and_the_new_turn_runs_R_API_2_R_RUN_6(user, replay_models):
    run, worker, result = run_answering(user)
    thread = run.thread
    # The next turn answers at once (the long answer's scenario has one turn).
    Conversation.objects.filter(pk=thread.pk).update(model="replay:plain_answer")

    response = submit(thread, "stop, and answer this", "interrupt")

    assert response.status_code == 202, response.content
    second = AgentRun.objects.get(pk=response.json()["run_id"])
    assert second.status == "pending"
    worker.join(WAIT_SECONDS)
    assert not worker.is_alive() and result["status"] == "cancelled"
    rows = Message.objects.filter(run=run, role="assistant")
    assert rows and all(row.execution_status == "interrupted" for row in rows)
    assert run_execute(run_id=second.id, owner="in-process") == "completed"
    assert AgentRun.objects.get(pk=second.pk).status == "completed"


def test_a_repeated_interrupt_returns_its_run_and_cancels_nothing_more_R_API_2_R_IDEM_1(thread):
    first = make_run(thread, text="first")
    request_id = uuid.uuid4().hex
    assert submit(thread, "second", "interrupt", request_id=request_id).status_code == 202
    assert AgentRun.objects.get(pk=first.pk).status == "cancelled"
    third = make_run(thread, text="third")  # queued after the second
    again = submit(thread, "second", "interrupt", request_id=request_id)
    assert again.status_code == 200, again.content
    assert AgentRun.objects.get(pk=third.pk).status == "pending"


@pytest.mark.parametrize("strategy", ["rollback ", "Interrupt", "", None, 1, "cancel"])
def test_an_unknown_strategy_is_422_and_changes_nothing_R_API_2_R_READ_6(thread, strategy):
    first = make_run(thread, text="first")
    body = {"request_id": uuid.uuid4().hex, "input": {"text": "second"}, "multitask_strategy": strategy}
    response = Client().post(
        f"/api/threads/{thread.id}/runs", json.dumps(body), content_type="application/json", headers=bearer(thread.user)
    )
    assert response.status_code == 422, response.content
    assert list(AgentRun.objects.values_list("pk", flat=True)) == [first.pk]
    assert AgentRun.objects.get(pk=first.pk).status == "pending"


def test_the_strategy_is_typed_in_the_openapi_document_R_API_2():
    schema = Client().get("/api/openapi.json").json()
    field = schema["components"]["schemas"]["RunIn"]["properties"]["multitask_strategy"]
    assert field["enum"] == ["enqueue", "reject", "interrupt", "rollback"] and field["default"] == "enqueue"
    responses = schema["paths"]["/api/threads/{thread_id}/runs"]["post"]["responses"]
    assert "409" in responses


# --------------------------------------------------------------------------
# rollback: the cancelled turn leaves the history and the memory
# --------------------------------------------------------------------------


def _texts(messages: list[dict]) -> list[str]:
    out = []
    for message in messages:
        content = message.get("content") or ""
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        out.append(f"{message['role']}: {content}")
    return out


def _answering_in(thread, text: str) -> tuple:
    """Execute a turn of ``text`` on ``thread`` (its model the long answer)
    in a thread; returned once it streams: (run, worker, result)."""
    import threading
    import time

    from django.db import connection

    run = make_run(thread, text=text)
    result: dict = {}

    def work():
        try:
            result["status"] = run_execute(run_id=run.id, owner="in-process")
        finally:
            connection.close()

    worker = threading.Thread(target=work)
    worker.start()
    deadline = time.monotonic() + WAIT_SECONDS
    while not (
        AgentRun.objects.get(pk=run.pk).status == "running"
        and Message.objects.filter(run=run, role="assistant").exists()
    ):
        assert time.monotonic() < deadline and worker.is_alive(), result
        time.sleep(0.02)
    return run, worker, result


def _use_model(thread, model: str) -> None:
    Conversation.objects.filter(pk=thread.pk).update(model=model)
    thread.refresh_from_db()


def test_rollback_takes_a_running_turn_out_of_history_memory_and_the_models_next_input_R_API_2(
    thread, replay_models, monkeypatch, staff_user
):
    _use_model(thread, "replay:plain_answer")
    kept = make_run(thread, text="kept question")
    assert run_execute(run_id=kept.id, owner="in-process") == "completed"
    _use_model(thread, "replay:long_answer")
    rolled, worker, result = _answering_in(thread, "rolled back question")
    _use_model(thread, "replay:plain_answer")
    sent = sent_requests(monkeypatch)

    response = submit(thread, "the question instead", "rollback")

    assert response.status_code == 202, response.content
    new = AgentRun.objects.get(pk=response.json()["run_id"])
    worker.join(WAIT_SECONDS)
    assert result["status"] == "cancelled"
    assert run_execute(run_id=new.id, owner="in-process") == "completed"
    # The model saw the kept turn and the new question, not the rolled-back one.
    texts = _texts(sent[-1])
    assert "user: kept question" in texts and "user: the question instead" in texts
    assert not [t for t in texts if "rolled back question" in t or "two minutes" in t], texts
    # History and memory no longer hold it; the run and its rows stay, marked.
    headers = bearer(thread.user)
    history = Client().get(f"/api/threads/{thread.id}/history", headers=headers).json()["items"]
    assert "rolled back question" not in json.dumps(history) and "the question instead" in json.dumps(history)
    memory = Client().get(f"/api/threads/{thread.id}/memory", headers=headers).json()["messages"]
    assert "rolled back question" not in json.dumps(memory) and "kept question" in json.dumps(memory)
    body = Client().get(f"/api/runs/{rolled.id}", headers=headers).json()
    assert body["status"] == "cancelled" and body["rolled_back_by"] == str(new.id)
    assert Client().get(f"/api/runs/{new.id}", headers=headers).json()["rolled_back_by"] is None
    assert Message.objects.filter(run=rolled, role="user", content="rolled back question").exists()
    assert Message.objects.filter(run=rolled, role="assistant", execution_status="interrupted").exists()
    # Staff see every row of it, marked, in the timelines and the exports.
    staff = bearer(staff_user)
    rows = Client().get(f"/api/audit/threads/{thread.id}/timeline", headers=staff).json()["items"]
    marks = {(row["run_id"], row["rolled_back"]) for row in rows}
    assert marks == {(str(kept.id), False), (str(rolled.id), True), (str(new.id), False)}
    one = Client().get(f"/api/audit/runs/{rolled.id}/timeline", headers=staff).json()["items"]
    assert one and all(row["rolled_back"] for row in one)
    export = Client().get(f"/api/audit/threads/{thread.id}/export", headers=staff)
    lines = [json.loads(line) for line in b"".join(export.streaming_content).decode().splitlines()]
    assert {(line["run_id"], line["rolled_back"]) for line in lines} == marks
    # The next turn goes on from the new line, without the rolled-back turn.
    after = submit(thread, "and then?")
    assert run_execute(run_id=after.json()["run_id"], owner="in-process") == "completed"
    texts = _texts(sent[-1])
    assert "user: the question instead" in texts and not [t for t in texts if "rolled back" in t], texts


def test_rolling_back_the_threads_first_turn_while_it_runs_starts_from_nothing_R_API_2(
    user, replay_models, monkeypatch
):
    rolled, worker, result = run_answering(user)
    thread = rolled.thread
    _use_model(thread, "replay:plain_answer")
    sent = sent_requests(monkeypatch)

    response = submit(thread, "start over", "rollback")

    assert response.status_code == 202, response.content
    worker.join(WAIT_SECONDS)
    assert result["status"] == "cancelled"
    assert run_execute(run_id=response.json()["run_id"], owner="in-process") == "completed"
    assert [t for t in _texts(sent[-1]) if t.startswith("user:")] == ["user: start over"]
    history = Client().get(f"/api/threads/{thread.id}/history", headers=bearer(user)).json()["items"]
    assert [item["kind"] for item in history] == ["user", "answer"]


def test_rolling_back_a_pending_turn_marks_every_run_of_it_R_API_2(thread, replay_models, monkeypatch):
    _use_model(thread, "replay:plain_answer")
    first = make_run(thread, text="never answered")
    sent = sent_requests(monkeypatch)
    response = submit(thread, "instead", "rollback")
    assert response.status_code == 202, response.content
    new_id = response.json()["run_id"]
    assert AgentRun.objects.get(pk=first.pk).status == "cancelled"
    assert RunRollback.objects.get(run_id=first.pk).by_run_id == uuid.UUID(new_id)
    assert run_execute(run_id=new_id, owner="in-process") == "completed"
    assert [t for t in _texts(sent[-1]) if t.startswith("user:")] == ["user: instead"]
    # Without a run pending or running, rollback rolls nothing back.
    quiet = submit(thread, "quietly", "rollback")
    assert quiet.status_code == 202 and RunRollback.objects.count() == 1


@contextlib.contextmanager
def _statements_on_every_connection():
    """The SQL of every statement sent through Django while open, on any
    thread's connection: the runner reads in threads of its own, each read
    on a connection opened for it."""
    sent: list[str] = []
    wrapped = []

    def record(execute, sql, params, many, context):
        sent.append(sql)
        return execute(sql, params, many, context)

    def wrap(sender=None, connection=connection, **kwargs):
        if record not in connection.execute_wrappers:
            connection.execute_wrappers.append(record)
            wrapped.append(connection)

    connection_created.connect(wrap)
    wrap()  # this thread's connection, perhaps open already
    try:
        yield sent
    finally:
        connection_created.disconnect(wrap)
        for each in wrapped:
            with contextlib.suppress(ValueError):
                each.execute_wrappers.remove(record)


def test_a_run_of_a_thread_without_a_rollback_reads_no_rollback_at_its_start_R_API_2(thread, replay_models):
    """Almost no thread has a rolled-back run: the acquisition tells
    (``thread_has_rollback``), and the run's start then reads no rollback,
    one query less at the start of every run but a thread's first. A
    thread with one still reads them."""
    _use_model(thread, "replay:plain_answer")
    assert run_execute(run_id=make_run(thread, text="first").id, owner="in-process") == "completed"
    lease, run = run_acquire_with_row(run_id=make_run(thread, text="second").id, owner="in-process", ttl_seconds=60)
    assert (run.thread_has_earlier_run, run.thread_has_rollback) == (True, False)
    with _statements_on_every_connection() as sent:
        assert run_execute_acquired(lease=lease, run=run, owner="in-process") == "completed"
    assert not [sql for sql in sent if "audit_runrollback" in sql]
    # The same capture sees the read on a thread with a rollback.
    make_run(thread, text="rolled back")
    response = submit(thread, "instead", "rollback")
    assert response.status_code == 202, response.content
    run_id = uuid.UUID(response.json()["run_id"])
    lease, run = run_acquire_with_row(run_id=run_id, owner="in-process", ttl_seconds=60)
    assert run.thread_has_rollback is True
    with _statements_on_every_connection() as sent:
        assert run_execute_acquired(lease=lease, run=run, owner="in-process") == "completed"
    assert [sql for sql in sent if "audit_runrollback" in sql]


def test_the_admin_marks_a_rolled_back_run_with_a_link_to_the_run_that_rolled_it_back_R_API_2(thread, staff_user):
    first = make_run(thread, text="first")
    response = submit(thread, "instead", "rollback")
    assert response.status_code == 202, response.content
    by_run = response.json()["run_id"]
    assert RunRollback.objects.get(run_id=first.pk).by_run_id == uuid.UUID(by_run)

    admin = Client()
    admin.force_login(staff_user)
    link = f'href="/admin/audit/agentrun/{by_run}/change/"'
    listing = admin.get("/admin/audit/agentrun/").content.decode()
    assert listing.count("yx-rolled-back") == 1 and link in listing
    page = admin.get(f"/admin/audit/agentrun/{first.pk}/change/").content.decode()
    assert "rolled back</a>" in page and link in page
    assert "yx-rolled-back" not in admin.get(f"/admin/audit/agentrun/{by_run}/change/").content.decode()
