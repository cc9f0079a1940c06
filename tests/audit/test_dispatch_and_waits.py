"""Dispatch from PostgreSQL and bounded waits, service by service, on real
PostgreSQL with a second connection holding locks (R-RUN-9, R-RUN-10).
The same faults on real processes: ``tests/faults``."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest
from django.db import transaction
from django.utils import timezone

from audit import ledger
from audit.errors import RunBusy
from audit.execution.dispatch import runs_dispatch
from audit.ledger.causes import failure_cause_send
from audit.models import AgentRun, RunCancelRequest
from conversations.models import Conversation
from tests.conftest import acquire, make_run

pytestmark = pytest.mark.django_db(transaction=True)


def _hold(lock_fn):
    """Hold a row lock taken by ``lock_fn`` in another thread (connection)
    until the returned ``release`` is called."""
    locked, release = threading.Event(), threading.Event()

    def hold():
        with transaction.atomic():
            lock_fn()
            locked.set()
            release.wait(20)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert locked.wait(10)

    def done():
        release.set()
        holder.join(10)

    return done


def test_cancel_while_a_worker_holds_the_row_answers_at_once_and_the_holder_applies_it_R_RUN_10(thread):
    run = make_run(thread)
    lease = acquire(run)
    release = _hold(lambda: AgentRun.objects.select_for_update(no_key=True).get(pk=run.id))
    try:
        began = time.monotonic()
        answered = ledger.run_request_cancel(user=thread.user, run_id=run.id)
        took = time.monotonic() - began
    finally:
        release()
    print(f"cancel answered in {took * 1000:.0f} ms while the row was held")
    assert took < 2.0
    assert answered.status == "cancel_requested"
    assert AgentRun.objects.get(pk=run.id).status == "running", "the row was not waited for"
    assert RunCancelRequest.objects.get(run_id=run.id).applied_at is None
    # The holder applies it at its next lease renewal.
    assert ledger.lease_renew(lease=lease, ttl_seconds=60) == "cancel_requested"
    assert AgentRun.objects.get(pk=run.id).status == "cancel_requested"
    assert RunCancelRequest.objects.get(run_id=run.id).applied_at is not None


def test_the_dispatcher_applies_a_recorded_cancel_once_the_row_is_free_R_RUN_10(thread):
    run = make_run(thread)
    release = _hold(lambda: AgentRun.objects.select_for_update(no_key=True).get(pk=run.id))
    try:
        ledger.run_request_cancel(user=thread.user, run_id=run.id)
        assert runs_dispatch()["cancels_applied"] == 0, "a held row is skipped"
    finally:
        release()
    assert runs_dispatch()["cancels_applied"] == 1
    assert AgentRun.objects.get(pk=run.id).status == "cancelled"


def test_a_cancel_on_a_free_row_still_applies_at_once_R_RUN_6(thread):
    run = make_run(thread)
    assert ledger.run_request_cancel(user=thread.user, run_id=run.id).status == "cancelled"
    assert RunCancelRequest.objects.get(run_id=run.id).applied_at is not None


def test_submit_gives_up_with_run_busy_when_the_thread_row_stays_locked_R_RUN_10(thread):
    release = _hold(lambda: Conversation.objects.select_for_update().get(pk=thread.id))
    try:
        began = time.monotonic()
        with pytest.raises(RunBusy) as caught:
            make_run(thread)
        took = time.monotonic() - began
    finally:
        release()
    assert caught.value.http_status == 503 and caught.value.code == "run_busy"
    assert took < 3.0
    assert not AgentRun.objects.filter(thread=thread).exists(), "nothing changed"


def test_the_dispatcher_hands_over_only_stale_runs_at_the_head_of_their_thread_R_RUN_9(thread):
    first, second = make_run(thread), make_run(thread)
    stale = timezone.now() - dt.timedelta(hours=1)
    AgentRun.objects.filter(pk__in=[first.pk, second.pk]).update(dispatched_at=stale)
    assert runs_dispatch()["dispatched"] == 1, "only the head of the thread"
    first.refresh_from_db()
    second.refresh_from_db()
    assert first.dispatched_at > stale and second.dispatched_at == stale
    assert runs_dispatch()["dispatched"] == 0, "within its grace again"
    # Once the head ends, the next run's grace starts from that moment.
    ledger.run_request_cancel(user=thread.user, run_id=first.id)
    second.refresh_from_db()
    assert second.dispatched_at > stale


def test_a_fresh_pending_run_is_not_handed_over_twice_R_RUN_9(thread):
    make_run(thread)
    assert runs_dispatch()["dispatched"] == 0


@pytest.mark.usefixtures("recovery_fail")
def test_the_sweeper_names_the_cause_the_worker_left_and_honours_a_cancel_R_RUN_8_R_RUN_10(thread, user):
    lost = make_run(thread)
    acquire(lost, ttl=1)
    failure_cause_send(run_id=lost.id, error_type="audit_write_failed", message="OperationalError: server closed")
    other = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    cancelled = make_run(other)
    acquire(cancelled, ttl=1)
    ledger.run_request_cancel(user=user, run_id=cancelled.id)
    crashed_thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    crashed = make_run(crashed_thread)
    acquire(crashed, ttl=1)
    swept = ledger.run_sweep_expired_leases(now=timezone.now() + dt.timedelta(seconds=5))
    assert set(swept) == {lost.id, cancelled.id, crashed.id}
    ended = {run.id: (run.status, run.error_type) for run in AgentRun.objects.filter(pk__in=swept)}
    assert ended[lost.id] == ("failed", "audit_write_failed")
    assert ended[cancelled.id] == ("cancelled", "cancelled")
    assert ended[crashed.id] == ("failed", "lease_expired")
