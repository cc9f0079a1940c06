"""The rows of the admin's audit timeline as HTML, built in Python (R-ADM-1,
issue 11).

``admin/audit/timeline.html`` used to render each row with template tags:
about 90 variable lookups, filters and escapes per row, 500 rows a page,
which cost a run page several hundred milliseconds of CPU. :func:`rows_html`
writes the same two ``<tr>`` per row with plain string formatting. The
output is the template's, byte for byte: every value goes through what the
template engine does to it (localisation of numbers, ``None`` shown as
``None``, HTML escaping unless already safe), and
``tests/admin/test_timeline_html.py`` renders the old row template beside
this function on varied rows. Change both together.
"""

from __future__ import annotations

import datetime as dt
import html
import unicodedata
from typing import Any

from django.conf import settings
from django.template.defaultfilters import truncatechars
from django.utils import timezone
from django.utils.formats import get_format, localize
from django.utils.html import conditional_escape
from django.utils.safestring import SafeData

from .templatetags.yx_admin import time_html, time_text


def _value(value: Any) -> str:
    """``{{ value }}`` in an autoescaping template: strings escaped, safe
    strings as they are, other values localised (numbers) and escaped."""
    if type(value) is str:
        return html.escape(value)
    if isinstance(value, SafeData):
        return value
    if timezone.is_aware(value) if isinstance(value, dt.datetime) else False:
        value = timezone.localtime(value)
    return conditional_escape(str(localize(value)))


def _number_formatter():
    """``{{ number }}`` for ints and floats: ``str`` when the active
    format has a ``.`` decimal separator and no grouping (en-us, the
    setting), else the template engine's own :func:`localize`."""
    if settings.USE_THOUSAND_SEPARATOR or get_format("DECIMAL_SEPARATOR") != ".":
        return _value

    def number(value: Any) -> str:
        kind = type(value)
        if kind is int or (kind is float and "e" not in repr(value)):
            return str(value)
        return _value(value)

    return number


def _plural(count: Any) -> str:
    """``{{ count|pluralize }}`` for a number."""
    return "" if count == 1 else "s"


def _summary(content: str) -> str:
    """``{{ content|truncatechars:120 }}``: the filter returns the text in
    NFC form, cut only when longer than 120 characters (not counting
    combining ones, which NFC length already bounds)."""
    text = unicodedata.normalize("NFC", content)
    return text if len(text) <= 120 else truncatechars(content, 120)


def _cut(cut: dict, part: str, number) -> str:
    """The note under a payload cut to its preview, with the link to the
    whole text (issue 37); ``static/audit/timeline.js`` loads it in place
    when the row is expanded."""
    return (
        f'<p class="yx-cut">first {number(cut["shown"])} of {number(cut["total"])} characters · '
        f'<a class="yx-full" href="{_value(cut["url"])}" data-yx-full="{part}">whole text</a></p>'
    )


def rows_html(rows: list[dict], *, show_run: bool) -> list[str]:
    """The HTML of each timeline row (display dicts of
    :func:`audit.admin.timeline_page_context`, nested): its main row and
    its detail row, with the whitespace the template had around them."""
    number = _number_formatter()
    # The current zone, looked up once: per time it was a context-local
    # lookup (four times a row).
    zone = timezone.get_current_timezone()
    colspan = "10" if show_run else "9"
    out = []
    for r in rows:
        v = _value
        depth = r["depth"]
        nested = " yx-nested" if depth else ""
        row_id = number(r["id"])
        ancestors = v(r["ancestor_ids"])
        status = v(r["status"])
        kind = v(r["kind"])
        parts = [
            f'\n      <tr class="yx-row yx-kind-{kind}{nested}" data-id="{row_id}" data-kind="{kind}" '
            f'data-status="{status}" data-depth="{number(depth)}" data-yx-ancestors="{ancestors}">\n        '
        ]
        if show_run:
            parts.append(f'<td class="yx-run"><a href="{v(r["run_url"])}">{html.escape(str(r["run_id"])[:8])}</a></td>')
        sequence = r["sequence"]
        parts.append(f'\n        <td class="yx-seq">{"—" if sequence is None else number(sequence)}</td>\n')
        parts.append(f'        <td><span class="yx-kind">{kind}</span>')
        if r["is_final_answer"]:
            parts.append(' <span class="yx-final">final answer</span>')
        elif r["asks_for_tools"]:
            try:
                calls = len(r["tool_calls"])
            except (ValueError, TypeError):
                calls = 0
            parts.append(f' <span class="yx-asks">tool call{_plural(calls)} for approval</span>')
        parts.append(f"</td>\n        <td>{v(r['status_badge'])}</td>\n")
        indent = r["indent_em"]
        style = f' style="padding-left:{number(indent)}em"' if indent else ""
        parts.append(f'        <td class="yx-op"{style}>')
        descendants = r["descendants"]
        if descendants:
            parts.append(
                f'<button type="button" class="yx-toggle" data-yx-toggle="{row_id}" aria-expanded="true" '
                'title="Show or hide the calls of this tool\'s subagent">'
                f"▾ {number(descendants)} subagent call{_plural(descendants)}</button><br>"
            )
        if depth:
            parts.append('<span class="yx-nest" aria-hidden="true">↳</span> ')
        parts.append(f"<strong>{v(r['label'])}</strong>")
        if r["agent_name"]:
            parts.append(f' <span class="yx-agent">{v(r["agent_name"])}</span>')
        parts.append(f"<br><code>{v(r['operation_id'])}</code>")
        if r["parent_elsewhere"]:
            parts.append(
                f'<br><span class="yx-quiet">under <code>{v(r["parent_operation_id"])}</code> (on another page)</span>'
            )
        started, finished = r["started_at"], r["finished_at"]
        parts.append(f'</td>\n        <td class="yx-num yx-started">{v(time_html(started, zone=zone))}</td>\n')
        bar = r["bar"]
        if bar:
            # The admin's one form of a time, with its zone (issue 37).
            end = v(time_text(finished, zone=zone)) if finished else "…"
            parts.append(
                '        <td class="yx-waterfall"><div class="yx-track">'
                f'<div class="yx-bar yx-status-{status}" style="margin-left:{number(bar["left"])}%;'
                f'width:{number(bar["width"])}%" title="{v(time_text(started, zone=zone))} → {end}"></div></div></td>\n'
            )
        else:
            parts.append('        <td class="yx-waterfall"><span class="yx-not-started">never started</span></td>\n')
        duration = r["duration_ms"]
        parts.append(f'        <td class="yx-num">{"—" if duration is None else number(duration) + " ms"}</td>\n')
        parts.append(f'        <td class="yx-num">{v(r["usage_text"])}</td>\n')
        parts.append(
            f'        <td class="yx-num yx-cost" title="{v(r["price_source"])} {v(r["price_version"])}">'
            f"{v(r['cost_text'])}</td>\n      </tr>\n"
        )
        parts.append(
            f'      <tr class="yx-detail{nested}" data-id="{row_id}" data-yx-ancestors="{ancestors}">\n'
            f'        <td colspan="{colspan}">\n          <details class="yx-details">\n            <summary>'
        )
        content = r["content"]
        if r["payload_note"]:
            parts.append(f'<em class="yx-payload-gone">{v(r["payload_note"])}</em>')
        else:
            parts.append(v(_summary(content) or "(no content)"))
        parts.append('</summary>\n            <div class="yx-body">\n              ')
        if r["workspace_path"]:
            parts.append(f'<p class="yx-workspace">workspace file <code>{v(r["workspace_path"])}</code></p>')
        parts.append("\n              ")
        if content:
            parts.append(f'<h4>content</h4><pre class="yx-pre">{v(content)}</pre>')
            if r["content_cut"]:
                parts.append(_cut(r["content_cut"], "content", number))
        parts.append("\n              ")
        if r["tool_calls_json"]:
            parts.append(f'<h4>declared tool calls</h4><pre class="yx-pre yx-declared">{v(r["tool_calls_json"])}</pre>')
            if r["tool_calls_cut"]:
                parts.append(_cut(r["tool_calls_cut"], "tool_calls", number))
        parts.append("\n              ")
        if r["tool_input_json"]:
            parts.append(f'<h4>tool input</h4><pre class="yx-pre">{v(r["tool_input_json"])}</pre>')
            if r["tool_input_cut"]:
                parts.append(_cut(r["tool_input_cut"], "tool_input", number))
        parts.append("\n              ")
        if r["raw_output_json"]:
            parts.append(f'<h4>raw tool output</h4><pre class="yx-pre yx-raw">{v(r["raw_output_json"])}</pre>')
            if r["raw_output_cut"]:
                parts.append(_cut(r["raw_output_cut"], "raw_output", number))
        parts.append("\n              ")
        if r["effect_key"]:
            # The effect ledger's identity of this tool execution, and the
            # row whose recorded result it returned instead of executing
            # again (R-EFF-1).
            parts.append(f'<p class="yx-effect">effect key <code>{v(r["effect_key"])}</code>')
            if r["replayed_from"]:
                parts.append(f" · result replayed from row #{number(r['replayed_from'])}")
            parts.append("</p>")
        attempt = r["attempt"]
        attempt_text = f"attempt {number(attempt)} · " if attempt and attempt > 1 else ""
        parts.append(
            f'\n              <p class="yx-times">{attempt_text}started {v(time_html(started, zone=zone))} · finished {v(time_html(finished, zone=zone))}'
            "</p>\n            </div>\n          </details>\n        </td>\n      </tr>\n    "
        )
        out.append("".join(parts))
    return out
