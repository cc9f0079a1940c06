"""The admin timeline's rows are written in Python (``audit.timeline_html``,
issue 11) and must be the markup the row template wrote, byte for byte:
``timeline_row_reference.html`` is that template, kept as the reference
(R-ADM-1, R-SUB-1)."""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path

import pytest
from django.template import engines
from django.test import RequestFactory
from django.utils import timezone
from django.utils.safestring import mark_safe

from audit.admin import status_badge, timeline_page_context
from audit.reads.selectors import run_timeline
from audit.timeline_html import rows_html
from tests.read.builders import RunDriver, tool_turn

REFERENCE = (Path(__file__).parent / "timeline_row_reference.html").read_text()
ODD = "nul \\u0000 <b>&\"quoted\"</b> 'single' é e\u0301 " + "long " * 40


def reference_html(rows: list[dict], *, show_run: bool) -> str:
    template = engines["django"].from_string(
        "{% load yx_admin %}{% for r in timeline_rows %}" + REFERENCE + "{% endfor %}"
    )
    return template.render({"timeline_rows": rows, "timeline_show_run": show_run})


def _row(i: int, **overrides) -> dict:
    start = dt.datetime(2026, 11, 30, 6, 23, 41, 517_123 + i, tzinfo=dt.UTC)
    row = {
        "id": 1_000_000 + i,
        "kind": "model",
        "run_id": uuid.UUID(int=i),
        "run_url": f"/admin/audit/agentrun/{uuid.UUID(int=i)}/change/?a=1&b=<2>",
        "operation_id": f"lc_run--{i}",
        "sequence": i,
        "status": "completed",
        "status_badge": status_badge("completed"),
        "started_at": start,
        "finished_at": start + dt.timedelta(milliseconds=12),
        "duration_ms": 12,
        "usage_text": "10 in / 5 out = 15",
        "cost_text": "$0.000123",
        "price_source": "genai-prices",
        "price_version": "0.0.1 <x>",
        "content": "It is sunny.",
        "tool_calls": None,
        "tool_calls_json": None,
        "tool_input_json": None,
        "raw_output_json": None,
        "label": "replay:plain_answer",
        "agent_name": None,
        "is_final_answer": False,
        "asks_for_tools": False,
        "payload_note": None,
        "workspace_path": None,
        "parent_operation_id": None,
        "parent_elsewhere": False,
        "bar": {"left": 12.5, "width": 0.6},
        "depth": 0,
        "indent_em": 0.0,
        "ancestor_ids": "",
        "descendants": 0,
        "effect_key": None,
        "replayed_from": None,
        "attempt": 1,
        "content_cut": None,
        "tool_calls_cut": None,
        "tool_input_cut": None,
        "raw_output_cut": None,
    }
    row.update(overrides)
    return row


VARIED = [
    _row(0),
    _row(1, is_final_answer=True, content=""),
    _row(2, asks_for_tools=True, tool_calls=[{"id": "a"}], tool_calls_json='[\n  {"id": "<a>"}\n]'),
    _row(3, asks_for_tools=True, tool_calls=[{"id": "a"}, {"id": "b"}]),
    _row(4, kind="tool", label=None, status=None, status_badge=status_badge(None), sequence=None, bar=None),
    _row(5, kind="tool", descendants=1, content=ODD, tool_input_json='{"q": "<x>"}', raw_output_json="{}"),
    _row(6, depth=1, indent_em=1.4, ancestor_ids="1000005", agent_name="researcher", descendants=3),
    _row(7, depth=2, indent_em=2.8, ancestor_ids="1000005 1000006", agent_name=7, started_at=None, bar=None),
    _row(8, parent_operation_id="call_<x>", parent_elsewhere=True, finished_at=None, duration_ms=None),
    _row(9, payload_note="payload purged on 2026-11-01", workspace_path="large_tool_results/a&b.txt"),
    _row(10, bar={"left": 0.0, "width": 100.0}, duration_ms=0, content="x" * 119 + "é"),
    _row(11, bar={"left": 33.333, "width": 1e-07}, content="a\u0301" * 130, cost_text="", usage_text="—"),
    _row(12, label=mark_safe("<i>safe</i>"), operation_id="", status="running", finished_at=None),
    _row(13, kind="tool", effect_key="9f<&>" + "0" * 59, attempt=2),
    _row(14, kind="tool", effect_key="a" * 64, replayed_from=1_234_567, attempt=3),
    # Payloads cut to their preview, each with the link to its whole text (issue 37).
    _row(
        15,
        kind="tool",
        content="y" * 2000,
        content_cut={"shown": 2000, "total": 1_000_000, "url": "/admin/x/?a=1&b=<2>"},
        tool_input_json='{"q": "<x>"}',
        tool_input_cut={"shown": 2000, "total": 12_345, "url": "/t"},
        raw_output_json="{}",
        raw_output_cut={"shown": 2000, "total": 1_000_123, "url": "/r"},
    ),
    _row(16, tool_calls_json="[]", tool_calls_cut={"shown": 2000, "total": 2001, "url": "/c"}),
]


@pytest.mark.parametrize("show_run", [False, True])
@pytest.mark.parametrize("zone", ["UTC", "Asia/Kolkata"])
def test_rows_html_is_the_row_template_R_ADM_1(show_run, zone):
    with timezone.override(zone):
        assert "".join(rows_html(VARIED, show_run=show_run)) == reference_html(VARIED, show_run=show_run)


@pytest.mark.django_db
def test_run_page_rows_are_the_row_template_R_ADM_1(thread):
    tool_turn(thread)
    d = RunDriver(thread, text=ODD)
    d.model("lc_run--o1", content=ODD, tool_calls=[{"id": "call_o", "name": "get_weather", "args": {"q": ODD}}])
    d.tool("call_o", declared_by="lc_run--o1", content=ODD, status="failed")
    d.model("lc_run--o2", finish=False)
    request = RequestFactory().get("/")
    context = timeline_page_context(request, lambda before: run_timeline(run_id=d.run.id), base_url="/", live=True)
    rows = context["timeline_rows"]
    assert len(rows) == 3
    assert context["timeline_rows_html"] == reference_html(rows, show_run=False)
    # The tool row shows its effect key (R-EFF-1); model rows have none.
    (tool,) = [r for r in rows if r["kind"] == "tool"]
    assert context["timeline_rows_html"].count('class="yx-effect"') == 1
    assert f"effect key <code>{tool['effect_key']}</code>" in context["timeline_rows_html"]


class _Row:
    def __init__(self, pk, text):
        self.pk, self.text = pk, text

    def __str__(self):
        return self.text


@pytest.mark.parametrize("pk", [7, uuid.UUID(int=5), 'a"<b>&'])
def test_action_checkbox_is_the_widgets_R_ADM_2(pk):
    from django.contrib import admin

    from yuxi_project.admin_rows import ActionCheckboxMixin

    row = _Row(pk, "run <b>\"x\"</b> & 'y' é")
    assert ActionCheckboxMixin().action_checkbox(row) == admin.ModelAdmin.action_checkbox(None, row)
