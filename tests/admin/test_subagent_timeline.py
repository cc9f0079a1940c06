"""The admin timeline nests a subagent's calls under the tool row that
spawned them: indented, collapsible, on the same waterfall scale
(R-SUB-1, R-ADM-1)."""

from __future__ import annotations

import asyncio
import re

import pytest
from django.urls import reverse

from audit import ledger
from audit.admin import nest_timeline_rows
from audit.execution.recorder import LifecycleRecorder
from conversations.models import Conversation, Message
from tests.audit.captures import load_capture
from tests.conftest import acquire, make_run

pytestmark = pytest.mark.django_db(transaction=True)


def _researcher_run(user):
    """The researcher capture (l) recorded into PostgreSQL, run completed."""
    (captured,) = load_capture("l_researcher_subagent")
    thread = Conversation.objects.create(user=user, agent_id="researcher", model="replay:researcher_fact_check")
    run = make_run(thread)
    lease = acquire(run)
    recorder = LifecycleRecorder(lease)

    async def feed() -> None:
        for event in captured.events:
            await recorder.handle(event)

    asyncio.run(feed())
    ledger.run_finish(lease=lease, status="completed", final_state=recorder.final_state())
    return run


def test_run_page_nests_subagent_calls_under_the_task_row_R_SUB_1_R_ADM_1(client, staff_user, user):
    run = _researcher_run(user)
    client.force_login(staff_user)
    html = client.get(reverse("admin:audit_agentrun_change", args=[run.pk])).content.decode()
    shown = re.findall(
        r'<tr class="yx-row[^"]*" data-id="(\d+)"[^>]*data-depth="(\d+)" data-yx-ancestors="([\d ]*)"', html
    )
    rows = {r.id: r for r in Message.objects.audit().filter(run=run)}
    assert len(shown) == len(rows) == 7
    task = next(r for r in rows.values() if r.operation_id == "call_task_fact_check")
    order = [int(row_id) for row_id, _, _ in shown]
    at = order.index(task.id)
    # The task row, then its four subagent calls (in sequence order), indented one level.
    children = sorted(
        (r for r in rows.values() if r.parent_operation_id == task.operation_id), key=lambda r: r.sequence
    )
    assert order[at + 1 : at + 5] == [r.id for r in children]
    for row_id, depth, ancestors in shown:
        nested = int(row_id) in {r.id for r in children}
        assert (depth, ancestors) == (("1", str(task.id)) if nested else ("0", ""))
    assert f'data-yx-toggle="{task.id}"' in html and "4 subagent calls" in html
    assert html.count('class="yx-bar') == 7, "every row on the one waterfall scale"
    assert html.count('<span class="yx-agent">fact_checker</span>') == 2
    # The detail rows fold with their rows.
    assert len(re.findall(rf'<tr class="yx-detail yx-nested" data-id="\d+" data-yx-ancestors="{task.id}"', html)) == 4


def _item(row_id, kind, op, seq, parent=None, run="r1"):
    return {
        "id": row_id,
        "kind": kind,
        "operation_id": op,
        "sequence": seq,
        "parent_operation_id": parent,
        "run_id": run,
    }


def test_parallel_task_calls_nest_their_own_subagents_and_a_parent_on_another_page_is_named_R_SUB_1():
    """Two task calls whose subagents interleave in sequence, a subagent
    nested in a subagent, a child whose task row is on an older page, and
    the same tool call id in another run of the thread."""
    items = [
        _item(1, "model", "lc_run--main", 1),
        _item(2, "tool", "call_a", 5),
        _item(3, "tool", "call_b", 6),
        _item(4, "model", "lc_run--a1", 7, parent="call_a"),
        _item(5, "model", "lc_run--b1", 8, parent="call_b"),
        _item(6, "tool", "call_a_inner", 9, parent="call_a"),
        _item(7, "model", "lc_run--a_inner", 10, parent="call_a_inner"),
        _item(8, "model", "lc_run--x", 11, parent="call_z"),
        _item(9, "model", "lc_run--other-run", 1, parent="call_a", run="r2"),
    ]
    rows = nest_timeline_rows([dict(i) for i in items])
    assert [r["id"] for r in rows] == [1, 2, 4, 6, 7, 3, 5, 8, 9]
    depth = {r["id"]: (r["depth"], r["ancestor_ids"], r["descendants"]) for r in rows}
    assert depth[2] == (0, "", 3) and depth[4] == (1, "2", 0) and depth[6] == (1, "2", 1) and depth[7] == (2, "2 6", 0)
    assert depth[3] == (0, "", 1) and depth[5] == (1, "3", 0)
    orphan = next(r for r in rows if r["id"] == 8)
    assert orphan["depth"] == 0 and orphan["parent_elsewhere"] is True
    assert next(r for r in rows if r["id"] == 9)["parent_elsewhere"] is True, "another run's call_a is not its parent"
    assert rows[0]["indent_em"] == 0 and next(r for r in rows if r["id"] == 7)["indent_em"] > 0
