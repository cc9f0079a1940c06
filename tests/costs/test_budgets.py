"""Budgets (R-COST-3): refusal at submit and resume creates nothing, the
admission check is serialised per user so concurrent submissions at the
edge of a budget let exactly the ones that fit pass, a running run stops
before its next model call, and bad budget input changes nothing."""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from decimal import Decimal
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from audit import ledger
from audit.execution.runner import run_execute
from audit.models import AgentRun
from conversations.models import Conversation, Message
from core.config import get_config
from core.errors import InvalidInput
from costs.budgets import BudgetExceeded, budget_admit, budget_check_running, period_start
from costs.models import Budget
from costs.services import budget_set
from tests.conftest import bearer

pytestmark = pytest.mark.django_db(transaction=True)


def _thread(user, model="replay:tool_then_answer") -> Conversation:
    return Conversation.objects.create(user=user, agent_id="assistant", model=model)


def _spend(user, usd: str, *, finished_at: dt.datetime | None = None) -> Message:
    """A completed model row of ``user`` that cost ``usd``."""
    thread = _thread(user)
    run = AgentRun.objects.create(
        request_id=uuid.uuid4().hex,
        thread=thread,
        user=user,
        agent_id="assistant",
        model=thread.model,
        status=AgentRun.Status.COMPLETED,
    )
    return Message.objects.create(
        thread=thread,
        run=run,
        role="assistant",
        message_type="model_audit",
        operation_id=uuid.uuid4().hex,
        execution_status="completed",
        finished_at=finished_at or dt.datetime.now(dt.UTC),
        usage={"input_tokens": 1, "output_tokens": 1},
        cost_usd=Decimal(usd),
        price_source="MODEL_PRICES",
    )


def _submit(client, user, thread, request_id: str):
    return client.post(
        f"/api/threads/{thread.id}/runs",
        data={"request_id": request_id, "input": {"text": "hi"}},
        content_type="application/json",
        headers=bearer(user),
    )


def test_submit_over_budget_is_402_with_the_figures_and_creates_nothing_R_COST_3(client, user, monkeypatch):
    monkeypatch.setattr(get_config(), "BUDGET_RUN_RESERVE_USD", Decimal("0"))
    thread = _thread(user)
    _spend(user, "0.75")
    budget_set(user=user, limit_usd="0.75", period="day")
    runs, messages = AgentRun.objects.count(), Message.objects.count()

    response = _submit(client, user, thread, "over-1")
    assert response.status_code == 402, response.content
    body = response.json()
    assert body["error"] == "budget_exceeded"
    assert (body["limit_usd"], body["spent_usd"], body["period"]) == ("0.75", "0.75", "day")
    assert (AgentRun.objects.count(), Message.objects.count()) == (runs, messages)

    # Raised, it fits again; a default budget applies to users without one.
    budget_set(user=user, limit_usd="1", period="day")
    ok = _submit(client, user, thread, "over-1")
    assert ok.status_code == 202, ok.content


def test_a_budget_below_one_run_s_reserve_says_the_reserve_does_not_fit_R_COST_3(client, user, monkeypatch):
    # The first turn under a budget smaller than one run's reserve: nothing is
    # spent, so "used up: 0 USD spent" would be false; the reserve is the reason.
    monkeypatch.setattr(get_config(), "BUDGET_RUN_RESERVE_USD", Decimal("0.05"))
    thread = _thread(user)
    budget_set(user=user, limit_usd="0.000001", period="day")

    response = _submit(client, user, thread, "tiny-1")
    assert response.status_code == 402, response.content
    body = response.json()
    assert body["error"] == "budget_exceeded"
    assert (body["limit_usd"], body["spent_usd"], body["period"]) == ("0.000001", "0", "day")
    assert (body["reserved_usd"], body["run_reserve_usd"]) == ("0", "0.05")
    assert "used up" not in body["message"], body["message"]
    assert "0.000001 USD left" in body["message"] and "reserve of 0.05 USD" in body["message"], body["message"]
    assert not AgentRun.objects.filter(thread=thread).exists()


def test_a_spent_up_budget_keeps_saying_it_is_used_up_R_COST_3(client, user, monkeypatch):
    monkeypatch.setattr(get_config(), "BUDGET_RUN_RESERVE_USD", Decimal("0.05"))
    thread = _thread(user)
    _spend(user, "0.75")
    budget_set(user=user, limit_usd="0.75", period="day")
    response = _submit(client, user, thread, "spent-1")
    assert response.status_code == 402, response.content
    body = response.json()
    assert body["message"] == "the day budget of 0.75 USD is used up: 0.75 USD spent", body["message"]
    assert (body["reserved_usd"], body["run_reserve_usd"]) == ("0", "0.05")


def test_the_default_budget_applies_to_users_without_their_own_R_COST_3(user, other_user, monkeypatch):
    monkeypatch.setattr(get_config(), "BUDGET_RUN_RESERVE_USD", Decimal("0"))
    budget_set(user=None, limit_usd="0.5", period="month")
    budget_set(user=other_user, limit_usd="100", period="month")
    _spend(user, "0.5")
    _spend(other_user, "0.5")
    with pytest.raises(BudgetExceeded) as refused:
        ledger.run_submit(user=user, thread_id=_thread(user).id, request_id=uuid.uuid4().hex, text="x")
    assert refused.value.extra["period"] == "month"
    ledger.run_submit(user=other_user, thread_id=_thread(other_user).id, request_id=uuid.uuid4().hex, text="x")


def test_spend_counts_the_current_period_in_the_budget_time_zone_R_COST_3(user, monkeypatch):
    monkeypatch.setattr(get_config(), "BUDGET_TIME_ZONE", "Asia/Shanghai")
    now = dt.datetime(2026, 3, 10, 20, 0, tzinfo=dt.UTC)  # 2026-03-11 04:00 in Shanghai
    assert period_start("day", now=now) == dt.datetime(2026, 3, 10, 16, 0, tzinfo=dt.UTC)
    assert period_start("month", now=now) == dt.datetime(2026, 2, 28, 16, 0, tzinfo=dt.UTC)
    from costs.selectors import spent_usd

    _spend(user, "1", finished_at=dt.datetime(2026, 3, 10, 15, 59, tzinfo=dt.UTC))  # yesterday there
    _spend(user, "2", finished_at=dt.datetime(2026, 3, 10, 16, 0, tzinfo=dt.UTC))  # today there
    assert spent_usd(user_id=user.pk, since=period_start("day", now=now)) == Decimal("2")
    assert spent_usd(user_id=user.pk, since=period_start("month", now=now)) == Decimal("3")


def test_the_running_check_reads_the_budget_that_applies_and_the_spend_of_its_period_R_COST_3(
    user, other_user, monkeypatch
):
    monkeypatch.setattr(get_config(), "BUDGET_TIME_ZONE", "Asia/Shanghai")
    now = dt.datetime(2026, 3, 10, 20, 0, tzinfo=dt.UTC)  # 2026-03-11 04:00 in Shanghai
    _spend(user, "1", finished_at=dt.datetime(2026, 3, 10, 15, 59, tzinfo=dt.UTC))  # yesterday there
    _spend(user, "2", finished_at=dt.datetime(2026, 3, 10, 16, 0, tzinfo=dt.UTC))  # today there
    budget_check_running(user_id=user.pk, now=now)  # no budget applies
    budget_set(user=None, limit_usd="3", period="day")  # the default: 2 of 3 spent today
    budget_check_running(user_id=user.pk, now=now)
    budget_set(user=None, limit_usd="3", period="month")  # 3 of 3 this month
    with pytest.raises(BudgetExceeded) as refused:
        budget_check_running(user_id=user.pk, now=now)
    assert (refused.value.extra["spent_usd"], refused.value.extra["period"]) == ("3", "month")
    budget_set(user=user, limit_usd="2.5", period="day")  # their own wins over the default
    budget_check_running(user_id=user.pk, now=now)
    budget_check_running(user_id=other_user.pk, now=now)  # the default, nothing spent
    budget_set(user=user, limit_usd="2", period="day")
    with pytest.raises(BudgetExceeded) as refused:
        budget_check_running(user_id=user.pk, now=now)
    assert (refused.value.extra["spent_usd"], refused.value.extra["limit_usd"]) == ("2", "2")


def test_concurrent_submits_at_the_edge_of_a_budget_admit_exactly_the_ones_that_fit_R_COST_3(user, monkeypatch):
    # Each unfinished run holds 0.01 USD: a 0.035 budget with 0.005 spent
    # has room for exactly 3 runs, whatever the timing.
    monkeypatch.setattr(get_config(), "BUDGET_RUN_RESERVE_USD", Decimal("0.01"))
    budget_set(user=user, limit_usd="0.035", period="day")
    _spend(user, "0.005")
    threads = [_thread(user) for _ in range(8)]
    barrier = threading.Barrier(len(threads))
    outcomes: list[str] = []

    def submit(thread):
        try:
            barrier.wait()
            ledger.run_submit(user=user, thread_id=thread.id, request_id=uuid.uuid4().hex, text="x")
            outcomes.append("admitted")
        except BudgetExceeded:
            outcomes.append("refused")
        except Exception as exc:  # reported below
            outcomes.append(repr(exc))
        finally:
            connection.close()

    workers = [threading.Thread(target=submit, args=(t,)) for t in threads]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert sorted(outcomes) == ["admitted"] * 3 + ["refused"] * 5, outcomes
    assert AgentRun.objects.filter(user=user, status="pending").count() == 3
    assert Message.objects.filter(thread__in=threads, role="user").count() == 3


def test_budget_admit_must_run_inside_the_creating_transaction_R_COST_3(user):
    budget_set(user=user, limit_usd="1", period="day")
    with pytest.raises(RuntimeError):
        budget_admit(user=user)


def test_a_running_run_that_crosses_its_budget_stops_before_its_next_model_call_R_COST_3(
    user, replay_models, monkeypatch
):
    # replay:tool_then_answer: call 1 (52 in, 14 out) costs 0.000108 USD at
    # the replay prices; the budget is used up after it, so the tool runs
    # but the second model call is never made.
    monkeypatch.setattr(get_config(), "BUDGET_RUN_RESERVE_USD", Decimal("0"))
    budget_set(user=user, limit_usd="0.0001", period="day")
    thread = _thread(user)
    run, _ = ledger.run_submit(user=user, thread_id=thread.id, request_id=uuid.uuid4().hex, text="Paris?")
    assert run_execute(run_id=run.id, owner="in-process") == "failed"
    run.refresh_from_db()
    assert run.error_type == "budget_exceeded", run.error_message
    model_rows = list(Message.objects.model_calls().filter(run=run))
    assert [(r.execution_status, r.cost_usd) for r in model_rows] == [("completed", Decimal("0.000108"))]
    assert list(Message.objects.tool_executions().filter(run=run).values_list("execution_status", flat=True)) == [
        "completed"
    ]
    assert not Message.objects.filter(run=run, execution_status="running").exists()
    # The next turn is refused at once: nothing more is spent.
    with pytest.raises(BudgetExceeded):
        ledger.run_submit(user=user, thread_id=thread.id, request_id=uuid.uuid4().hex, text="again")


@pytest.mark.parametrize(
    ("usd", "period"),
    [
        ("-1", "day"),
        ("NaN", "day"),
        ("Infinity", "month"),
        ("abc", "day"),
        ("0.0000001", "day"),
        ("1e15", "day"),
        ("5", "week"),
        ("5", ""),
    ],
)
def test_bad_budget_input_is_refused_and_changes_nothing_R_COST_3(user, usd, period):
    budget_set(user=user, limit_usd="5", period="day")
    with pytest.raises(InvalidInput):
        budget_set(user=user, limit_usd=usd, period=period)
    budget = Budget.objects.get(user=user)
    assert (budget.limit_usd, budget.period) == (Decimal("5"), "day")


def test_set_budget_command_R_COST_3(user):
    out = StringIO()
    call_command("set_budget", user.username, "--usd", "2.50", "--period", "month", stdout=out)
    assert "2.5 USD per month" in out.getvalue()
    assert (Budget.objects.get(user=user).limit_usd, Budget.objects.get(user=user).period) == (Decimal("2.5"), "month")
    call_command("set_budget", "--default", "--usd", "1", "--period", "day", stdout=StringIO())
    assert Budget.objects.get(user__isnull=True).limit_usd == Decimal("1")

    for argv in (
        [user.username, "--usd", "-3", "--period", "day"],
        [user.username, "--usd", "3", "--period", "year"],
        ["no-such-user", "--usd", "3", "--period", "day"],
        [user.username, "--usd", "3"],
        ["--usd", "3", "--period", "day"],
    ):
        with pytest.raises(CommandError):
            call_command("set_budget", *argv, stdout=StringIO(), stderr=StringIO())
    assert (Budget.objects.get(user=user).limit_usd, Budget.objects.count()) == (Decimal("2.5"), 2)

    call_command("set_budget", user.username, "--remove", stdout=StringIO())
    assert not Budget.objects.filter(user=user).exists()


def test_one_default_budget_only_R_COST_3(user):
    from django.db import IntegrityError

    budget_set(user=None, limit_usd="1", period="day")
    with pytest.raises(IntegrityError):
        Budget.objects.create(user=None, limit_usd=Decimal("2"), period="day")


def test_a_model_row_opens_only_while_the_budget_has_room_in_one_statement_R_COST_3(user, monkeypatch):
    """The check before a model call is part of the statement that opens
    its row (no round trip of its own, issue 11): within the budget the
    row opens in one statement; over it, no row opens and the refusal
    names the figures, also when the row was already open."""
    from django.test.utils import CaptureQueriesContext

    from tests.conftest import acquire, make_run

    monkeypatch.setattr(get_config(), "BUDGET_RUN_RESERVE_USD", Decimal("0"))
    budget_set(user=user, limit_usd="3", period="day")
    lease = acquire(make_run(_thread(user)))
    now = dt.datetime.now(dt.UTC)

    def open_call(operation_id: str):
        return ledger.model_call_open(
            lease=lease, operation_id=operation_id, sequence=1, started_at=now, budget_user_id=user.pk
        )

    _spend(user, "2")
    with CaptureQueriesContext(connection) as queries:
        opened = open_call("lc_run--a")
    assert opened.execution_status == "running"
    assert len(queries) == 1, [q["sql"][:80] for q in queries]
    _spend(user, "1")  # 3 of 3 spent today
    with pytest.raises(BudgetExceeded) as refused:
        open_call("lc_run--b")
    assert (refused.value.extra["spent_usd"], refused.value.extra["limit_usd"]) == ("3", "3")
    assert not Message.objects.filter(run_id=lease.run_id, operation_id="lc_run--b").exists()
    with pytest.raises(BudgetExceeded):
        open_call("lc_run--a")  # already open: refused all the same
    budget_set(user=user, limit_usd="4", period="day")
    assert open_call("lc_run--b").operation_id == "lc_run--b"


def test_a_lost_lease_is_named_before_the_budget_when_a_model_row_would_open_R_RUN_4(user, monkeypatch):
    """A run taken over while its user's budget is spent: opening a model
    row raises the lease error (R-RUN-4), not the budget's."""
    from django.db.models import F

    from audit.errors import LeaseError
    from tests.conftest import acquire, make_run

    run = make_run(_thread(user))
    lease = acquire(run)
    budget_set(user=user, limit_usd="1", period="day")
    _spend(user, "2")
    AgentRun.objects.filter(pk=run.id).update(lease_owner="worker-new", fencing_token=F("fencing_token") + 1)
    with pytest.raises(LeaseError):
        ledger.model_call_open(
            lease=lease,
            operation_id="lc_run--a",
            sequence=1,
            started_at=dt.datetime.now(dt.UTC),
            budget_user_id=user.pk,
        )
