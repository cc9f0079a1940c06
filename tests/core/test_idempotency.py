"""Idempotency keys are scoped per user and shared by submit and resume
(R-IDEM-1, R-RUN-1): a retry answers the same run (200), a different request
under the same key answers 409 ``request_id_reused`` and changes nothing,
another user's equal key is independent — also when the requests arrive at
the same moment (threads behind a barrier, each with its own connection)."""

from __future__ import annotations

import json
import threading
from collections import Counter

import pytest
from django.db import connection
from django.test import Client

from audit import ledger
from audit.models import AgentRun
from conversations.models import Conversation, Message
from tests.conftest import acquire, bearer, make_run

pytestmark = pytest.mark.django_db(transaction=True)

INTERRUPT = [
    {
        "id": "intr-1",
        "value": {
            "action_requests": [{"name": "send_email", "args": {"to": "a@b.c", "subject": "s", "body": "b"}}],
            "review_configs": [{"action_name": "send_email", "allowed_decisions": ["approve", "edit", "reject"]}],
        },
    }
]


def _new_thread(user) -> Conversation:
    return Conversation.objects.create(user=user, agent_id="assistant", model="replay:approval_send_email")


def _interrupted_run(thread) -> AgentRun:
    run = make_run(thread, text="email ops")
    ledger.run_finish(lease=acquire(run), status="interrupted", interrupts=INTERRUPT)
    run.refresh_from_db()
    return run


def _turn(headers, thread_id, request_id, text="hello"):
    return Client().post(
        f"/api/threads/{thread_id}/runs",
        data=json.dumps({"request_id": request_id, "input": {"text": text}}),
        content_type="application/json",
        headers=headers,
    )


def _resume(headers, run_id, request_id, decisions=({"type": "approve"},)):
    return Client().post(
        f"/api/runs/{run_id}/resume",
        data=json.dumps({"request_id": request_id, "decisions": list(decisions)}),
        content_type="application/json",
        headers=headers,
    )


def _snapshot():
    """Everything a refused request must leave unchanged."""
    return (
        sorted(AgentRun.objects.values_list("id", "status", "request_id", "request_fingerprint")),
        Message.objects.count(),
    )


def _assert_reused(response):
    assert response.status_code == 409, response.content
    error = response.json()["error"]
    assert error["code"] == "request_id_reused" and error["reason"] == "request_id_reused"


# --------------------------------------------------------------------------
# One request at a time
# --------------------------------------------------------------------------


def test_a_repeated_turn_answers_the_same_run_and_creates_no_second_R_IDEM_1_R_RUN_1(user):
    thread, headers = _new_thread(user), bearer(user)
    first = _turn(headers, thread.id, "turn-1")
    again = _turn(headers, thread.id, "turn-1")
    assert (first.status_code, again.status_code) == (202, 200)
    assert first.json()["run_id"] == again.json()["run_id"]
    assert AgentRun.objects.filter(thread=thread).count() == 1
    assert Message.objects.filter(thread=thread, role="user").count() == 1


@pytest.mark.parametrize("change", ["other_text", "other_thread"])
def test_a_turn_key_reused_for_another_turn_is_409_and_changes_nothing_R_IDEM_1(user, change):
    thread, headers = _new_thread(user), bearer(user)
    assert _turn(headers, thread.id, "turn-1", "first text").status_code == 202
    before = _snapshot()
    target = _new_thread(user).id if change == "other_thread" else thread.id
    _assert_reused(_turn(headers, target, "turn-1", "other text" if change == "other_text" else "first text"))
    assert _snapshot() == before


def test_a_resume_key_sent_as_a_turn_is_409_and_drops_nothing_silently_R_IDEM_1(user):
    thread, headers = _new_thread(user), bearer(user)
    origin = _interrupted_run(thread)
    resumed = _resume(headers, origin.id, "resume-1")
    assert resumed.status_code == 202
    ledger.run_request_cancel(user=user, run_id=resumed.json()["run_id"])  # frees the thread for turns
    before = _snapshot()
    _assert_reused(_turn(headers, thread.id, "resume-1", "a new question"))
    assert _snapshot() == before
    assert not Message.objects.filter(content="a new question").exists()


def test_a_turn_key_sent_as_a_resume_is_409_and_resumes_nothing_R_IDEM_1(user):
    thread, headers = _new_thread(user), bearer(user)
    origin = _interrupted_run(thread)
    before = _snapshot()
    _assert_reused(_resume(headers, origin.id, origin.request_id))
    assert _snapshot() == before
    assert not AgentRun.objects.filter(resumed_from=origin).exists()


def test_a_repeated_resume_answers_the_same_run_and_other_decisions_are_409_R_IDEM_1(user):
    thread, headers = _new_thread(user), bearer(user)
    origin = _interrupted_run(thread)
    first = _resume(headers, origin.id, "resume-1", [{"type": "reject", "message": "no"}])
    again = _resume(headers, origin.id, "resume-1", [{"type": "reject", "message": "no"}])
    assert (first.status_code, again.status_code) == (202, 200)
    assert first.json()["run_id"] == again.json()["run_id"]
    before = _snapshot()
    _assert_reused(_resume(headers, origin.id, "resume-1", [{"type": "approve"}]))
    _assert_reused(_resume(headers, origin.id, "resume-1", [{"type": "reject", "message": "other reason"}]))
    assert _snapshot() == before
    # Another key for the same interrupted run is no retry: the run was resumed.
    refused = _resume(headers, origin.id, "resume-2")
    assert refused.status_code == 409 and refused.json()["error"]["reason"] == "already_resumed"
    # It names the resume run, as a refused cancel does (resumed_by).
    assert refused.json()["error"]["resumed_by"] == first.json()["run_id"]


def test_a_resume_key_reused_for_another_interrupted_run_is_409_R_IDEM_1(user):
    headers = bearer(user)
    first = _interrupted_run(_new_thread(user))
    second = _interrupted_run(_new_thread(user))
    assert _resume(headers, first.id, "resume-1").status_code == 202
    before = _snapshot()
    _assert_reused(_resume(headers, second.id, "resume-1"))
    assert _snapshot() == before


def test_another_users_equal_key_is_independent_and_reveals_nothing_R_IDEM_1(user, other_user):
    mine, theirs = _new_thread(user), _new_thread(other_user)
    first = _turn(bearer(user), mine.id, "shared-key", "mine")
    second = _turn(bearer(other_user), theirs.id, "shared-key", "theirs")
    assert (first.status_code, second.status_code) == (202, 202)
    assert first.json()["run_id"] != second.json()["run_id"]
    # The resume side shares the scope: a key another user gave a resume is
    # free for this user's turn.
    origin = _interrupted_run(_new_thread(other_user))
    assert _resume(bearer(other_user), origin.id, "their-resume").status_code == 202
    assert _turn(bearer(user), _new_thread(user).id, "their-resume", "x").status_code == 202
    # Each user's retry still finds their own run.
    assert _turn(bearer(user), mine.id, "shared-key", "mine").json()["run_id"] == first.json()["run_id"]
    assert _turn(bearer(other_user), theirs.id, "shared-key", "theirs").json()["run_id"] == second.json()["run_id"]


def test_runs_created_before_fingerprints_compare_by_their_stored_request_R_IDEM_1(user):
    """Rows from before the fingerprint column have it empty: retries and
    reuses are told apart from the stored thread, resumed run and input."""
    thread, headers = _new_thread(user), bearer(user)
    origin = _interrupted_run(thread)
    resumed = _resume(headers, origin.id, "resume-1", [{"type": "edit", "args": {"to": "x@y.z"}}])
    assert resumed.status_code == 202
    AgentRun.objects.update(request_fingerprint="")
    again = _resume(headers, origin.id, "resume-1", [{"type": "edit", "args": {"to": "x@y.z"}}])
    assert again.status_code == 200 and again.json()["run_id"] == resumed.json()["run_id"]
    _assert_reused(_resume(headers, origin.id, "resume-1", [{"type": "edit", "args": {"to": "other@y.z"}}]))
    assert _turn(headers, thread.id, origin.request_id, "email ops").json()["run_id"] == str(origin.id)
    _assert_reused(_turn(headers, thread.id, origin.request_id, "other text"))


# --------------------------------------------------------------------------
# At the same moment
# --------------------------------------------------------------------------


def _fire_together(calls):
    """Run the callables at the same moment (a barrier), each in its own
    thread with its own database connection; returns their responses."""
    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)

    def worker(index, call):
        try:
            barrier.wait(timeout=10)
            results[index] = call()
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[index] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


@pytest.mark.parametrize("trial", range(3))
def test_identical_turns_at_the_same_moment_answer_one_run_R_IDEM_1(user, trial):
    thread, headers = _new_thread(user), bearer(user)
    responses = _fire_together([lambda: _turn(headers, thread.id, "same")] * 4)
    assert Counter(r.status_code for r in responses) == {202: 1, 200: 3}, [r.content for r in responses]
    assert len({r.json()["run_id"] for r in responses}) == 1
    assert AgentRun.objects.filter(thread=thread).count() == 1
    assert Message.objects.filter(thread=thread, role="user").count() == 1


@pytest.mark.parametrize("trial", range(3))
def test_conflicting_turns_at_the_same_moment_create_one_run_and_one_409_R_IDEM_1(user, trial):
    headers = bearer(user)
    thread, other_thread = _new_thread(user), _new_thread(user)
    responses = _fire_together(
        [
            lambda: _turn(headers, thread.id, "same", "one text"),
            lambda: _turn(headers, thread.id, "same", "another text"),
            lambda: _turn(headers, other_thread.id, "same", "one text"),
        ]
    )
    assert sorted(r.status_code for r in responses) == [202, 409, 409], [r.content for r in responses]
    for response in responses:
        if response.status_code == 409:
            _assert_reused(response)
    assert AgentRun.objects.filter(request_id="same").count() == 1
    assert Message.objects.filter(role="user").count() == 1


@pytest.mark.parametrize("trial", range(3))
def test_identical_resumes_at_the_same_moment_answer_one_resume_run_R_IDEM_1(user, trial):
    origin, headers = _interrupted_run(_new_thread(user)), bearer(user)
    responses = _fire_together([lambda: _resume(headers, origin.id, "same-resume")] * 4)
    assert Counter(r.status_code for r in responses) == {202: 1, 200: 3}, [r.content for r in responses]
    assert len({r.json()["run_id"] for r in responses}) == 1
    assert AgentRun.objects.filter(resumed_from=origin).count() == 1


@pytest.mark.parametrize("trial", range(3))
def test_conflicting_resumes_and_turns_at_the_same_moment_R_IDEM_1(user, trial):
    """One key for a resume, a resume with other decisions, and a turn of
    another thread: exactly one run, the others 409 request_id_reused."""
    headers = bearer(user)
    origin, elsewhere = _interrupted_run(_new_thread(user)), _new_thread(user)
    responses = _fire_together(
        [
            lambda: _resume(headers, origin.id, "key"),
            lambda: _resume(headers, origin.id, "key", [{"type": "reject"}]),
            lambda: _turn(headers, elsewhere.id, "key", "a turn"),
        ]
    )
    assert sorted(r.status_code for r in responses) == [202, 409, 409], [r.content for r in responses]
    for response in responses:
        if response.status_code == 409:
            _assert_reused(response)
    assert AgentRun.objects.filter(user=user, request_id="key").count() == 1


def test_different_keys_resuming_one_run_at_the_same_moment_one_wins_R_TA_5(user):
    origin, headers = _interrupted_run(_new_thread(user)), bearer(user)
    responses = _fire_together(
        [lambda: _resume(headers, origin.id, "key-a"), lambda: _resume(headers, origin.id, "key-b")]
    )
    assert sorted(r.status_code for r in responses) == [202, 409]
    refused = next(r for r in responses if r.status_code == 409)
    assert refused.json()["error"]["reason"] == "already_resumed"
    assert AgentRun.objects.filter(resumed_from=origin).count() == 1
    winner = next(r for r in responses if r.status_code == 202)
    assert refused.json()["error"]["resumed_by"] == winner.json()["run_id"]
