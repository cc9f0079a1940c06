"""Runs are handed to workers only at their thread's head (R-RUN-2,
R-RUN-9): a turn queued behind other turns costs no broker message and no
refused acquisition until the run before it ends, and the dispatcher's
round looks at heads only, so no number of queued turns on one thread
holds back another thread's lost run. Real PostgreSQL; each broker
message is recorded where it would be sent."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from django.db import connection, transaction
from django.utils import timezone

from audit import ledger
from audit.execution.dispatch import runs_dispatch
from audit.models import AgentRun
from conversations.models import Conversation
from tests.conftest import acquire, make_run, resume_row_of

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def handed(monkeypatch) -> list:
    """The ids of the runs handed to the broker, in order."""
    sent: list = []

    def record(run_id) -> bool:
        sent.append(run_id)
        return True

    for module in ("audit.ledger.runs", "audit.ledger.terminal", "audit.execution.dispatch"):
        monkeypatch.setattr(f"{module}.enqueue_run", record)
    return sent


def _stale(*runs, hours: float) -> None:
    """As if each run's broker message went out ``hours`` ago and was lost."""
    at = timezone.now() - dt.timedelta(hours=hours)
    AgentRun.objects.filter(pk__in=[run.pk for run in runs]).update(dispatched_at=at)


def test_a_queue_of_turns_costs_one_handover_per_turn_R_RUN_2_R_RUN_9(thread, handed):
    runs = [make_run(thread, text=f"turn {i}") for i in range(5)]
    assert handed == [runs[0].id], "only the head is handed over; the others wait for their turn"
    for i, run in enumerate(runs):
        before = timezone.now()
        ledger.run_finish(lease=acquire(run), status="completed")
        if i + 1 < len(runs):
            assert handed[-1] == runs[i + 1].id, "the run's end hands over the next turn"
            assert AgentRun.objects.get(pk=runs[i + 1].pk).dispatched_at >= before, "its grace starts now"
    assert handed == [run.id for run in runs], "one message per turn, not one per waiting turn per end"


def test_an_interrupted_turn_keeps_the_head_until_its_resume_ends_R_RUN_2(thread, handed):
    first = make_run(thread)
    lease = acquire(first)
    waiting = make_run(thread)
    assert handed == [first.id]
    ledger.run_finish(lease=lease, status="interrupted", interrupts=[{"id": "i1", "value": {}}])
    assert handed == [first.id], "the thread waits for the approval: nothing to hand over"
    resume = resume_row_of(first)
    ledger.run_finish(lease=acquire(resume), status="completed")
    assert handed == [first.id, waiting.id]


def test_a_turn_submitted_while_the_run_before_it_ends_is_handed_over_once_R_RUN_2(thread, handed):
    """The submission commits after the run's end read the thread's head
    (which did not see it yet): the submission's own look after its commit
    finds the thread free and hands it over."""
    first = make_run(thread)
    lease = acquire(first)
    ended = threading.Event()

    def finish() -> None:
        try:
            ledger.run_finish(lease=lease, status="completed")
        finally:
            connection.close()
            ended.set()

    with transaction.atomic():
        second = make_run(thread)
        threading.Thread(target=finish, daemon=True).start()
        assert ended.wait(30)
        assert handed == [first.id], "the end committed before the turn: it saw no pending run"
    assert AgentRun.objects.get(pk=first.pk).status == "completed"
    assert handed == [first.id, second.id]


def test_the_dispatcher_looks_past_any_number_of_queued_turns_R_RUN_9(thread, user, handed):
    """Queued turns that are not at their thread's head never fill the
    round's ``limit``: the lost heads of both threads go out."""
    head = make_run(thread)
    queued = [make_run(thread, text=f"later {i}") for i in range(3)]
    other = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    lost = make_run(other)
    _stale(head, lost, hours=1)
    _stale(*queued, hours=5)  # longest waiting, but behind ``head``
    handed.clear()
    assert runs_dispatch(limit=2)["dispatched"] == 2
    assert sorted(handed) == sorted([head.id, lost.id])
    assert {run.dispatched_at for run in AgentRun.objects.filter(pk__in=[q.pk for q in queued])} == {
        AgentRun.objects.get(pk=queued[0].pk).dispatched_at
    }, "the queued turns were not touched"


def test_the_dispatcher_hands_over_a_resume_before_a_later_turn_R_RUN_2_R_RUN_9(thread, handed):
    first = make_run(thread)
    lease = acquire(first)
    later = make_run(thread)  # submitted before the resume, a later turn
    ledger.run_finish(lease=lease, status="interrupted", interrupts=[{"id": "i1", "value": {}}])
    resume = resume_row_of(first)
    _stale(later, resume, hours=1)
    handed.clear()
    assert runs_dispatch()["dispatched"] == 1
    assert handed == [resume.id]


def test_a_submission_that_committed_answers_even_when_its_hand_over_cannot_read_R_RUN_9(
    thread, handed, monkeypatch, caplog
):
    """The look at the thread's head runs after the commit: a database
    error there is logged, never raised (the run exists; the dispatcher
    hands it over after its grace)."""
    from django.db import OperationalError

    def unreachable():
        raise OperationalError("server closed the connection unexpectedly")

    first = make_run(thread)  # holds the thread: the next turn's hand-over reads the head
    monkeypatch.setattr("audit.ledger.runs.at_head", unreachable)
    run = make_run(thread)
    assert AgentRun.objects.get(pk=run.pk).status == "pending"
    assert handed == [first.id]
    assert "not handed over (the dispatcher will)" in caplog.text


def test_a_turn_of_a_free_thread_is_handed_over_without_reading_the_head_R_RUN_9(thread, handed, monkeypatch):
    """The submission saw, with the thread locked, that no run held it:
    the new run is the head, and no read after the commit is needed."""

    def unread():
        raise AssertionError("the head was read")

    first = make_run(thread)
    ledger.run_finish(lease=acquire(first), status="completed")
    monkeypatch.setattr("audit.ledger.runs.at_head", unread)
    second = make_run(thread)
    assert handed == [first.id, second.id]


def test_a_run_behind_the_head_is_refused_naming_the_head_turns_run_R_RUN_2(thread, handed):
    """A second delivery of a queued turn is refused, and the refusal names
    the run it waits for: the head turn's, not the turn just before it —
    the rule of :func:`audit.ledger.turns.head_turn`, typed once."""
    from audit.errors import RunNotStartable

    first = make_run(thread)
    lease = acquire(first)
    second, third = make_run(thread, text="second"), make_run(thread, text="third")
    ledger.run_finish(lease=lease, status="interrupted", interrupts=[{"id": "i1", "value": {}}])
    resume = resume_row_of(first)  # the head turn's pending resume, submitted after both
    for queued in (second, third):
        with pytest.raises(RunNotStartable, match=f"waits for run {resume.id} \\(pending\\)"):
            acquire(queued)
    assert set(AgentRun.objects.filter(pk__in=[second.pk, third.pk]).values_list("status", flat=True)) == {"pending"}
    ledger.run_finish(lease=acquire(resume), status="completed")
    with pytest.raises(RunNotStartable, match=f"waits for run {second.id} \\(pending\\)"):
        acquire(third)
    ledger.run_finish(lease=acquire(second), status="completed")
    ledger.run_finish(lease=acquire(third), status="completed")


def _run_rows_visited(plan: dict) -> int:
    """Rows the plan's nodes read from the run table, times their loops."""
    visited = plan["Actual Rows"] * plan["Actual Loops"] if plan.get("Relation Name") == "audit_agentrun" else 0
    return visited + sum(_run_rows_visited(child) for child in plan.get("Plans", ()))


def test_the_dispatcher_reads_a_thread_once_however_many_turns_wait_R_RUN_9(thread, handed):
    """The head of a thread is computed once per round, not once per queued
    turn: with n stale turns behind a running head, the round reads the
    thread's runs a bounded number of times n, not n times n."""
    from django.test.utils import CaptureQueriesContext

    head = make_run(thread)
    acquire(head)
    queued = [make_run(thread, text=f"later {i}") for i in range(60)]
    _stale(*queued, hours=1)
    with CaptureQueriesContext(connection) as captured:
        assert runs_dispatch()["dispatched"] == 0
    (claim,) = [q["sql"] for q in captured.captured_queries if "SKIP LOCKED" in q["sql"]]
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {claim}")
        plan = cursor.fetchone()[0][0]["Plan"]
    visited = _run_rows_visited(plan)
    assert visited < 10 * len(queued), f"{visited} run rows read for {len(queued)} queued turns"
