"""Orders and cursors of the index-driven readers (issue 11): timelines and
history read a thread's runs first and each run's rows through its own
index, and must give exactly the order the ORM definition gives — rows
without a sequence last in their run, a rejected approval row (sequence 0)
first in its resume run, user message first in a turn — and cursors that
page back through every row once, across runs and across rows without a
sequence (R-READ-1, R-READ-3, R-TA-5)."""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.db.models import Case, Value, When
from django.db.models.functions import Coalesce

from audit.ledger import StateMessage
from audit.reads.selectors import _NO_SEQUENCE, _SCOPE, run_timeline, thread_timeline, timeline_sql
from conversations.models import Message
from conversations.selectors import history_sql, memory_rows, memory_sql, thread_history, thread_memory
from core.db import serial_plans
from tests.admin.test_rough_edges import interrupted_run, rejected_resume

from .builders import RunDriver, tool_turn

pytestmark = pytest.mark.django_db


def mixed_thread(thread):
    """A turn with a tool, a turn whose final State proved a model call the
    stream never saw (inserted without a sequence), an approval rejected in
    a resume run (the rejected row has sequence 0), and a failed run."""
    tool_turn(thread, prefix="a")
    d = RunDriver(thread, text="second")
    d.model("lc_run--b1", tool_calls=[{"id": "call_b", "name": "get_weather", "args": {"city": "Oslo"}}])
    d.tool("call_b", declared_by="lc_run--b1")
    d.state.append(StateMessage(kind="ai", id="lc_run--b-missed", content="Proved by the State only."))
    d.finish()
    rejected_resume(interrupted_run(thread))
    failed = RunDriver(thread, text="fourth")
    failed.model("lc_run--d1", content="partial", in_state=False)
    failed.finish("failed", error_type="model_error")


def reference_timeline(thread):
    """The timeline order as the ORM defines it (the old reader)."""
    return list(
        Message.objects.audit()
        .filter(thread=thread)
        .order_by("run__created_at", "run_id", Coalesce("sequence", Value(_NO_SEQUENCE)), "id")
        .values_list("id", flat=True)
    )


def reference_history(thread):
    return list(
        Message.objects.filter(thread=thread, run__isnull=False)
        .visible_in_history()
        .order_by(
            "run__created_at",
            "run_id",
            Case(When(role=Message.Role.USER, then=Value(0)), default=Value(1)),
            Coalesce("sequence", Value(_NO_SEQUENCE)),
            "id",
        )
        .values_list("id", flat=True)
    )


def test_thread_timeline_order_and_cursor_match_the_definition_R_READ_3_R_TA_5(thread):
    mixed_thread(thread)
    expected = reference_timeline(thread)
    assert [row.id for row in thread_timeline(thread_id=thread.id).items] == expected
    missed = Message.objects.get(operation_id="lc_run--b-missed")
    rejected = Message.objects.get(execution_status="rejected")
    assert missed.sequence is None and rejected.sequence == 0
    # The row without a sequence closes its run; the rejected row opens the resume run.
    run_b = [i for i in expected if Message.objects.get(pk=i).run_id == missed.run_id]
    assert run_b[-1] == missed.id
    resume_rows = list(
        Message.objects.audit().filter(run=rejected.run).order_by("sequence").values_list("id", flat=True)
    )
    assert expected.index(rejected.id) == expected.index(resume_rows[0]) == min(expected.index(i) for i in resume_rows)
    for limit in (1, 2, 3):
        seen, before = [], None
        while True:
            page = thread_timeline(thread_id=thread.id, limit=limit, before=before)
            seen = [row.id for row in page.items] + seen
            if not page.truncated:
                break
            before = page.next_before
        assert seen == expected, limit


def test_run_timeline_cursor_pages_through_a_row_without_sequence_R_READ_3(thread):
    d = RunDriver(thread)
    for i in range(4):
        d.model(f"lc_run--m{i}", content=f"c{i}", in_state=False)
    d.state.append(StateMessage(kind="ai", id="lc_run--late", content="late"))
    d.state.append(StateMessage(kind="ai", id="lc_run--later", content="later"))
    run = d.finish()
    everything = [row.operation_id for row in run_timeline(run_id=run.id).items]
    assert everything[-2:] == ["lc_run--late", "lc_run--later"]
    seen, before = [], None
    while True:
        page = run_timeline(run_id=run.id, limit=1, before=before)
        seen = [row.operation_id for row in page.items] + seen
        if not page.truncated:
            break
        before = page.next_before
    assert seen == everything
    # A cursor keeps its meaning, "rows before this key": a later run's
    # cursor on this run's timeline gives all of it.
    other = tool_turn(thread, prefix="z")
    page = run_timeline(run_id=other.id, limit=1)
    assert [row.operation_id for row in run_timeline(run_id=run.id, before=page.next_before).items] == everything


def test_history_and_memory_match_the_definition_and_page_once_R_READ_1_R_READ_2(thread):
    mixed_thread(thread)
    expected = reference_history(thread)
    assert [e.message.id for e in thread_history(thread=thread, limit=200).items] == expected
    for limit in (1, 2, 5):
        seen, before = [], None
        while True:
            page = thread_history(thread=thread, limit=limit, before=before)
            seen = [e.message.id for e in page.items] + seen
            if not page.has_more:
                break
            before = page.next_before
        assert seen == expected, limit
    memory_ids = [m["id"] for m in thread_memory(thread_id=thread.id, include_tools=True) if m["type"] != "tool"]
    by_id = {m.id: m for m in Message.objects.filter(pk__in=expected)}
    assert memory_ids == [
        f"msg-{i}" if by_id[i].role == "user" or not by_id[i].operation_id else by_id[i].operation_id
        for i in expected
        if by_id[i].role == "user" or by_id[i].content or by_id[i].tool_calls
    ]


# -- plans -------------------------------------------------------------------


def _plan(sql: str, params: list, *, no_sort: bool = False) -> str:
    """The plan of ``sql``. Tiny test tables make sequential scans and
    sorts of one estimated row cheapest; the question here is which index
    can supply the order and take the cursor, not the costs, so those are
    priced out (``enable_seqscan``, and with ``no_sort`` ``enable_sort``)."""
    settings = ["enable_seqscan"] + (["enable_sort"] if no_sort else [])
    with connection.cursor() as cursor:
        for name in settings:
            cursor.execute(f"SET LOCAL {name} = off")
        cursor.execute("EXPLAIN " + sql, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        for name in settings:
            cursor.execute(f"RESET {name}")
    return plan


def test_timeline_page_is_a_bounded_backward_index_scan_with_the_cursor_inside_R_READ_3(thread):
    run = tool_turn(thread)
    sql, params = timeline_sql("id", limit=501, cursor=[run.created_at, run.id, 2, 10**9])
    params = [run.id if p is _SCOPE else p for p in params]
    plan = _plan(sql, params, no_sort=True)
    # The rows come in display order from the (run, sequence, id) index,
    # the cursor is a bound of that scan, and no sort reads the run's rows.
    assert "Index Scan Backward using message_run_sequence_idx" in plan, plan
    assert re.search(r"Index Cond: \(\(run_id = \w+\.id\) AND \(ROW\(sequence, id\) < ROW\(", plan), plan
    scan_lines = [line for line in plan.splitlines() if "message_run_sequence_idx" in line]
    assert scan_lines and all("Limit" not in line for line in scan_lines)
    assert "Sort Key: conversations_message" not in plan, plan


def test_history_reads_runs_by_the_thread_index_then_rows_by_run_R_READ_1(thread):
    tool_turn(thread)
    sql, params = history_sql(thread.id, limit=51)
    # The order of the thread's runs comes from the index: asked without
    # sorts (statistics of a tiny table sometimes make sorting its one
    # estimated run the cheaper plan).
    plan = _plan(sql, params, no_sort=True)
    assert "run_thread_created_idx" in plan, plan
    assert "Nested Loop" in plan and "conversations_message_run_id" in plan, plan
    # No scan of the thread's messages by thread id: rows come run by run.
    assert "conversations_message_thread_id" not in plan and "message_thread_id_idx" not in plan, plan


def _make_parallel_plans_free() -> None:
    """For the rest of the test's transaction, price parallel workers and
    page reads at nothing (and sequential scans out): on tiny tables the
    planner then takes parallel workers wherever they are allowed — as a
    large table's sampled statistics sometimes make it do for a long
    thread's runs."""
    with connection.cursor() as cursor:
        for name in (
            "parallel_setup_cost",
            "parallel_tuple_cost",
            "min_parallel_table_scan_size",
            "min_parallel_index_scan_size",
            "random_page_cost",
            "seq_page_cost",
        ):
            cursor.execute(f"SET LOCAL {name} = 0")
        cursor.execute("SET LOCAL enable_seqscan = off")


@pytest.mark.parametrize("include_tools", [False, True])
def test_memory_walks_the_runs_then_each_runs_rows_never_with_parallel_workers_R_READ_2(thread, include_tools):
    tool_turn(thread)
    tool_turn(thread, prefix="b")
    sql, params = memory_sql(thread.id, include_tools=include_tools)
    # The walk, as thread_memory reads it (prepared, in serial_plans): the
    # thread's runs, then each run's rows, fetched for that run.
    plan = "\n".join(row[0] for row in memory_rows("EXPLAIN " + sql, params))
    assert "Nested Loop" in plan and "(run_id = audit_agentrun.id)" in plan, plan
    assert re.search(r"Index Scan (using|on) (run_thread_created_idx|audit_agentrun_thread_id)", plan), plan
    assert "Hash" not in plan and "Merge Join" not in plan, plan
    assert "message_thread_id_idx" not in plan and "conversations_message_thread_id" not in plan, plan
    # Parallel workers made free: allowed, the planner takes them for the
    # runs (on a large table, the thread's runs' estimate sometimes does
    # that); the walk never has any.
    _make_parallel_plans_free()
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + sql, params)
        allowed = "\n".join(row[0] for row in cursor.fetchall())
    assert "Gather" in allowed, allowed
    plan = "\n".join(row[0] for row in memory_rows("EXPLAIN " + sql, params))
    assert "Gather" not in plan and "Parallel" not in plan, plan


def _parallel_workers() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('max_parallel_workers_per_gather')")
        return cursor.fetchone()[0]


def test_serial_plans_turn_parallel_workers_off_for_their_block_only_inside_a_transaction():
    before = _parallel_workers()
    assert before != "0"
    with serial_plans():
        assert _parallel_workers() == "0"
    assert _parallel_workers() == before  # the outer transaction has its setting back
    with pytest.raises(RuntimeError), serial_plans():
        assert _parallel_workers() == "0"
        raise RuntimeError("the block fails")
    assert _parallel_workers() == before


@pytest.mark.django_db(transaction=True)
def test_serial_plans_own_transaction_ends_the_setting():
    before = _parallel_workers()
    with serial_plans():
        assert connection.in_atomic_block and _parallel_workers() == "0"
    assert not connection.in_atomic_block and _parallel_workers() == before


def test_rows_read_by_raw_statements_carry_no_search_vector_R_READ_3(thread):
    run = tool_turn(thread)
    row = run_timeline(run_id=run.id).items[0]
    assert "search_vector" not in row.__dict__
    assert not row.get_deferred_fields()
