"""Cost on the model rows through the audit services (R-COST-1): priced
when the row closes (message-finish, or the terminal transaction for rows
the final State completed or proved), unknown when cut off before usage,
and never an obstacle to closing a row or ending a run."""

from __future__ import annotations

from decimal import Decimal

import genai_prices
import pytest
from django.utils import timezone

from audit import ledger
from conversations.models import Conversation, Message
from costs.selectors import run_cost
from tests.conftest import acquire, make_run

pytestmark = pytest.mark.django_db

USAGE = {"input_tokens": 100, "output_tokens": 50, "total_tokens": 150}
REPLAY_COST = (100 * Decimal("1.00") + 50 * Decimal("4.00")) / Decimal(1_000_000)


def _start(lease, op, seq):
    ledger.model_call_start(lease=lease, operation_id=op, sequence=seq, started_at=timezone.now(), metadata={})


def _finish(lease, op, usage=USAGE, **metadata):
    return ledger.model_call_finish(
        lease=lease,
        operation_id=op,
        content="hi",
        tool_calls=[],
        usage=usage,
        finished_at=timezone.now(),
        duration_ms=3,
        metadata=metadata,
    )


def test_model_call_finish_prices_the_row_and_a_repeat_changes_nothing_R_COST_1(thread):
    lease = acquire(make_run(Conversation.objects.create(user=thread.user, agent_id="assistant", model="replay:x")))
    _start(lease, "op-1", 1)
    row = _finish(lease, "op-1")
    assert (row.cost_usd, row.price_source, row.price_version) == (REPLAY_COST, "replay-default", "1")
    again = _finish(lease, "op-1")
    assert again.cost_usd == REPLAY_COST
    assert Message.objects.get(pk=row.pk).cost_usd == REPLAY_COST


def test_catalogue_price_uses_the_reported_model_R_COST_1(user):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="openai:gpt-4o-mini")
    lease = acquire(make_run(thread))
    _start(lease, "op-1", 1)
    row = _finish(lease, "op-1", model_name="gpt-4o-mini-2024-07-18")
    at = Message.objects.get(pk=row.pk).started_at
    expected = genai_prices.calc_price(
        genai_prices.Usage(input_tokens=100, output_tokens=50),
        "gpt-4o-mini",
        provider_id="openai",
        genai_request_timestamp=at,
    ).total_price
    assert row.cost_usd == expected and row.price_source == "genai-prices"


def test_unknown_price_or_broken_usage_still_closes_the_row_with_unknown_cost_R_COST_1(user):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="openai:no-such-model")
    lease = acquire(make_run(thread))
    _start(lease, "op-1", 1)
    _start(lease, "op-2", 2)
    no_price = _finish(lease, "op-1")
    broken = _finish(
        lease, "op-2", usage={"input_tokens": 10, "output_tokens": 1, "input_token_details": {"cache_read": 20}}
    )
    assert (no_price.execution_status, no_price.cost_usd, no_price.metadata["cost_unknown"]) == (
        "completed",
        None,
        "price_unknown",
    )
    assert (broken.execution_status, broken.cost_usd, broken.metadata["cost_unknown"]) == (
        "completed",
        None,
        "usage_invalid",
    )
    run = ledger.run_finish(lease=lease, status="completed")
    assert run.status == "completed"
    assert run_cost(run.id) == {"total_usd": None, "unknown_cost_calls": 2}


def test_a_catalogue_failure_is_logged_and_gives_unknown_R_COST_1(user, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("catalogue exploded")

    monkeypatch.setattr(genai_prices.data_snapshot.DataSnapshot, "find_provider_model", broken)
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="openai:gpt-4o-mini")
    lease = acquire(make_run(thread))
    _start(lease, "op-1", 1)
    row = _finish(lease, "op-1")
    assert (row.execution_status, row.cost_usd, row.metadata["cost_unknown"]) == ("completed", None, "price_error")
    assert "catalogue exploded" in caplog.text


def test_rows_closed_by_the_terminal_transaction_R_COST_1(user):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:x")
    lease = acquire(make_run(thread))
    _start(lease, "lc_run--proved", 1)  # the State proves it with usage
    _start(lease, "lc_run--cut", 2)  # cut off: no usage anywhere
    state = [
        ledger.StateMessage(kind="human", id="h"),
        ledger.StateMessage(kind="ai", id="lc_run--proved", content="a", usage=USAGE),
        ledger.StateMessage(kind="ai", id="lc_run--state-only", content="b", usage=USAGE),
    ]
    run = ledger.run_finish(lease=lease, status="failed", final_state=state, error_type="x")
    rows = {r.operation_id: r for r in Message.objects.model_calls().filter(run=run)}
    assert rows["lc_run--proved"].cost_usd == REPLAY_COST
    assert rows["lc_run--state-only"].cost_usd == REPLAY_COST
    assert (rows["lc_run--cut"].execution_status, rows["lc_run--cut"].cost_usd) == ("failed", None)
    assert run_cost(run.id) == {"total_usd": 2 * REPLAY_COST, "unknown_cost_calls": 1}


def test_a_running_call_is_neither_known_nor_unknown_R_COST_2(user):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:x")
    run = make_run(thread)
    lease = acquire(run)
    _start(lease, "op-1", 1)
    assert run_cost(run.id) == {"total_usd": None, "unknown_cost_calls": 0}
    _finish(lease, "op-1")
    _start(lease, "op-2", 2)
    assert run_cost(run.id) == {"total_usd": REPLAY_COST, "unknown_cost_calls": 0}
    ledger.run_request_cancel(user=user, run_id=run.id)
    ledger.run_finish(lease=lease, status="cancelled", error_type="cancelled")
    assert run_cost(run.id) == {"total_usd": REPLAY_COST, "unknown_cost_calls": 1}
