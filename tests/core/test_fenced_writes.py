"""Audit writes as one statement fenced by the lease (R-RUN-4, R-RUN-5):
the statement waits for a transaction that holds the run row and re-checks
the lease on the row it committed; live events go out in batches."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading

import pytest
from django.conf import settings
from django.db import connection, transaction

from audit import ledger
from audit.errors import LeaseLost, RunTerminal
from audit.execution.events import RunEventPublisher, stream_key
from audit.ledger.lease import lock_run
from audit.ledger.tool_audit import effect_key
from audit.models import AgentRun
from conversations.models import Conversation, Message
from tests.conftest import acquire, make_run, prepared_executed_since, prepared_executions

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _write_in_thread(lease, outcome: dict) -> threading.Thread:
    def write():
        try:
            ledger.model_call_start(lease=lease, operation_id="lc_run--late", sequence=3, started_at=T0)
            outcome["result"] = "written"
        except Exception as exc:
            outcome["result"] = exc
        finally:
            connection.close()

    worker = threading.Thread(target=write)
    worker.start()
    return worker


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("change, error", [("terminal", RunTerminal), ("takeover", LeaseLost)])
def test_a_write_waiting_on_the_run_row_rechecks_the_lease_after_the_holder_commits_R_RUN_4(thread, change, error):
    """The holder (a terminal transaction, a takeover) commits while the
    write waits for the row lock: the write then finds the committed row,
    writes nothing and names why."""
    lease = acquire(make_run(thread))
    outcome: dict = {}
    with transaction.atomic():
        run = lock_run(lease)
        worker = _write_in_thread(lease, outcome)
        worker.join(timeout=0.5)
        assert worker.is_alive(), "the write must wait for the row lock"
        if change == "terminal":
            AgentRun.objects.filter(pk=run.pk).update(status="failed", lease_expires_at=None)
        else:
            AgentRun.objects.filter(pk=run.pk).update(lease_owner="someone-else", fencing_token=run.fencing_token + 1)
    worker.join(timeout=10)
    assert isinstance(outcome["result"], error)
    assert not Message.objects.audit().filter(operation_id="lc_run--late").exists()


@pytest.mark.django_db
def test_open_then_start_share_one_row_and_finish_prices_it_once_R_MA_10_R_COST_1(thread):
    lease = acquire(make_run(thread))
    opened = ledger.model_call_open(lease=lease, operation_id="lc_run--a", sequence=2, started_at=T0)
    started = ledger.model_call_start(
        lease=lease, operation_id="lc_run--a", sequence=4, started_at=T0, metadata={"namespace": []}
    )
    assert started.pk == opened.pk and started.sequence == 4
    assert "awaiting_first_chunk" not in started.metadata and started.metadata["attempts"] == 1
    usage = {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15}
    closed = ledger.model_call_finish(
        lease=lease,
        operation_id="lc_run--a",
        content="hi\x00there",
        tool_calls=[],
        usage=usage,
        finished_at=T0 + dt.timedelta(seconds=1),
        duration_ms=1000,
    )
    closed.refresh_from_db()
    assert closed.execution_status == "completed" and closed.content == "hi\x00there"  # R-RUN-11 escaped form
    assert closed.cost_usd is not None and closed.price_source == "replay-default"
    assert Message.objects.audit().filter(run_id=lease.run_id).count() == 1


def test_live_events_wait_in_a_batch_and_close_sends_them_all_in_order_R_EVT_1():
    import redis

    run_id = "batch-test-run"
    client = redis.Redis.from_url(settings.CONFIG.REDIS_URL)
    client.delete(stream_key(run_id))

    async def go():
        publisher = RunEventPublisher(run_id, settings.CONFIG.REDIS_URL)
        for i in range(5):
            await publisher.publish("model.delta", {"text": str(i)})
        waiting = client.xlen(stream_key(run_id))
        await publisher.publish("run.finished", {"status": "completed"})
        await publisher.close()
        return waiting

    try:
        assert asyncio.run(go()) == 0  # nothing sent per event
        entries = client.xrange(stream_key(run_id))
        assert [e[0] for e in entries] == [f"{i}-0".encode() for i in range(1, 7)]
        assert entries[-1][1][b"type"] == b"run.finished"
        assert 0 < client.ttl(stream_key(run_id)) <= 24 * 3600
    finally:
        client.delete(stream_key(run_id))
        client.close()


def test_an_event_published_while_a_batch_is_in_flight_is_sent_with_the_next_R_EVT_1():
    """Found by a newcomer: an event published while the timer's flush
    awaited Redis was deleted with the batch in flight, never sent, and the
    stream's ids stayed consecutive (a silent loss). Every event of every
    interleaving of publish and flush reaches the stream, once, in order."""
    import redis

    run_id = "batch-in-flight-run"
    client = redis.Redis.from_url(settings.CONFIG.REDIS_URL)
    client.delete(stream_key(run_id))

    async def go():
        publisher = RunEventPublisher(run_id, settings.CONFIG.REDIS_URL)
        await publisher.publish("a", {"n": 1})
        in_flight = asyncio.ensure_future(publisher.flush())  # what the timer does
        await asyncio.sleep(0)  # the flush now awaits Redis
        await publisher.publish("b", {"n": 2})
        await in_flight
        await publisher.publish("c", {"n": 3})
        for n in range(4, 40):  # more flushes racing publishes
            racing = asyncio.ensure_future(publisher.flush())
            await asyncio.sleep(0)
            await publisher.publish(f"e{n}", {"n": n})
            await racing
        await publisher.close()

    try:
        asyncio.run(go())
        entries = client.xrange(stream_key(run_id))
        assert [e[1][b"type"].decode() for e in entries] == ["a", "b", "c", *[f"e{n}" for n in range(4, 40)]]
        assert [e[0] for e in entries] == [f"{i}-0".encode() for i in range(1, 40)]
    finally:
        client.delete(stream_key(run_id))
        client.close()


@pytest.mark.django_db(transaction=True)
def test_fenced_writes_are_prepared_once_per_connection_R_RUN_5(thread):
    """Each lifecycle write is planned once per connection, not on every
    write (planning was half of a write's time): Django turns psycopg's
    prepared statements off unless the connection allows them."""
    lease = acquire(make_run(thread))
    ledger.model_call_start(lease=lease, operation_id="lc_run--p0", sequence=1, started_at=T0)
    before = prepared_executions("WITH leased_run AS %")
    for i in range(1, 4):
        ledger.model_call_start(lease=lease, operation_id=f"lc_run--p{i}", sequence=i + 1, started_at=T0)
    assert prepared_executed_since(before, "WITH leased_run AS %") == [3], (
        "the model row's start must be one statement prepared on this connection"
    )


@pytest.mark.django_db(transaction=True)
def test_the_rollup_of_a_run_end_is_prepared_once_per_connection_R_DASH_1(thread):
    """The rollup statement of a run's end is planned once per connection:
    planning it took three times its execution."""
    # (The write of the run's end marks it; the rollup adds its figures.)
    ledger.run_finish(lease=acquire(make_run(thread, request_id="rollup-0")), status="completed")
    before = prepared_executions("WITH f0 AS MATERIALIZED %")
    for i in range(1, 3):
        ledger.run_finish(lease=acquire(make_run(thread, request_id=f"rollup-{i}")), status="completed")
    assert prepared_executed_since(before, "WITH f0 AS MATERIALIZED %") == [2]


@pytest.mark.django_db(transaction=True)
def test_the_terminal_read_sent_with_the_lock_sees_what_the_lock_holder_committed_R_RUN_5(thread):
    """run_finish sends its lock and the read of the run's rows in one round
    trip: the read must still run once the lock is held, so a row that the
    holder wrote and committed meanwhile is closed with the run."""
    lease = acquire(make_run(thread))
    outcome: dict = {}

    def finish():
        try:
            outcome["run"] = ledger.run_finish(lease=lease, status="completed")
        except Exception as exc:
            outcome["run"] = exc
        finally:
            connection.close()

    with transaction.atomic():
        lock_run(lease)
        row = Message.objects.create(
            thread=thread,
            run_id=lease.run_id,
            role=Message.Role.ASSISTANT,
            operation_id="lc_run--held",
            sequence=1,
            execution_status=Message.ExecutionStatus.RUNNING,
            started_at=T0,
        )
        worker = threading.Thread(target=finish)
        worker.start()
        worker.join(timeout=0.5)
        assert worker.is_alive(), "the terminal transaction must wait for the row lock"
    worker.join(timeout=10)
    assert getattr(outcome["run"], "status", outcome["run"]) == "completed"
    row.refresh_from_db()
    # Closed by the run's end: a call still running in a completed run was abandoned.
    assert row.execution_status == "abandoned" and row.finished_at is not None


@pytest.mark.django_db
def test_a_write_that_reads_nothing_back_stores_the_row_the_loading_write_stores_R_MA_3_R_TA_2(thread):
    """The worker's writes ask for no row back (``returning=False``): each
    service then returns None, and the row stored is field for field the
    one the same write stores when it returns the row."""

    def lifecycle(lease, returning: bool) -> list:
        op, call = "lc_run--x", "call-x"
        common = {"lease": lease, "returning": returning}
        return [
            ledger.model_call_open(operation_id=op, sequence=1, started_at=T0, metadata={"namespace": []}, **common),
            ledger.model_call_start(
                operation_id=op, sequence=2, started_at=T0, metadata={"ls_model_name": "m"}, **common
            ),
            ledger.model_call_finish(
                operation_id=op,
                content="hi\x00",
                tool_calls=[{"id": call, "name": "get_weather", "args": {"city": "Par\x00is"}}],
                usage={"input_tokens": 3, "output_tokens": 2, "total_tokens": 5},
                finished_at=T0,
                duration_ms=7,
                metadata={"finish_reason": "tool_calls"},
                **common,
            ),
            ledger.tool_call_start(
                tool_call_id=call,
                tool_name="get_weather",
                tool_input={"city": "Par\x00is"},
                sequence=3,
                started_at=T0,
                declared_by_operation_id=op,
                metadata={},
                **common,
            ),
            ledger.tool_call_error(tool_call_id=call, error="boom", **common),
            ledger.tool_call_finish(
                tool_call_id=call,
                status="failed",
                content="boom",
                raw_output={"content": "boom"},
                finished_at=T0,
                duration_ms=1,
                **common,
            ),
        ]

    other = Conversation.objects.create(user=thread.user, agent_id=thread.agent_id, model=thread.model)
    loaded_lease, silent_lease = acquire(make_run(thread)), acquire(make_run(other))
    loaded, silent = lifecycle(loaded_lease, True), lifecycle(silent_lease, False)
    assert all(isinstance(row, Message) for row in loaded) and silent == [None] * 6
    # The effect key names the run's turn (R-EFF-1): compared as "the key
    # of this row's turn", as the declaring row is compared as "declared".
    skip = {"id", "thread", "run", "created_at", "updated_at", "declared_by", "effect_key"}
    names = [f.name for f in Message._meta.concrete_fields if f.name not in skip]

    def stored(lease) -> list[dict]:
        rows = Message.objects.audit().filter(run_id=lease.run_id).order_by("role")
        return [
            {n: getattr(row, n) for n in names}
            | {"declared": row.declared_by_id is not None}
            | {"keyed": row.effect_key == (effect_key(lease.turn_id, row.operation_id) if row.role == "tool" else None)}
            for row in rows
        ]

    assert stored(loaded_lease) == stored(silent_lease) and len(stored(silent_lease)) == 2


@pytest.mark.django_db(transaction=True)
def test_prepared_statements_are_planned_once_not_on_every_call_R_RUN_5(thread):
    """PostgreSQL kept planning the model row's open (with its budget
    condition) afresh on every call, its plan for the call's values looking
    cheaper than its plan for any values: 0.9 ms of planning for 0.2 ms of
    execution. The prepared statements are planned once per connection."""
    lease = acquire(make_run(thread))
    for i in range(8):
        ledger.model_call_open(
            lease=lease, operation_id=f"lc_run--o{i}", sequence=i + 1, started_at=T0, budget_user_id=thread.user_id
        )
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE %s",
            ["WITH leased_run AS %costs_budget%"],
        )
        [(generic, custom)] = cursor.fetchall()
    assert (generic, custom) == (8, 0)
