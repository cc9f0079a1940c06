"""The admin's display helpers written for speed (issue 11) give what the
slower forms they replaced gave: times as ``strftime`` and Django's date
format wrote them, tool input and output indented as the standard encoder
indents them."""

from __future__ import annotations

import datetime as dt
import json
import zoneinfo

from django.utils import timezone
from hypothesis import given, settings
from hypothesis import strategies as st

from audit.admin import _pretty
from audit.templatetags.yx_admin import time_html, time_text

ZONES = [
    dt.UTC,
    dt.timezone(dt.timedelta(hours=-3, minutes=-30)),
    *map(zoneinfo.ZoneInfo, ("Asia/Shanghai", "America/New_York")),
]
# From year 1000: strftime writes earlier years without their leading zero.
moments = st.datetimes(min_value=dt.datetime(1000, 1, 2), max_value=dt.datetime(2200, 1, 1))


@settings(max_examples=300, deadline=None)
@given(moment=moments, stored=st.sampled_from(ZONES), shown=st.sampled_from(ZONES), aware=st.booleans())
def test_times_read_as_strftime_and_djangos_date_format_wrote_them_in_the_zone_shown(moment, stored, shown, aware):
    value = moment.replace(tzinfo=stored) if aware else moment
    local = timezone.localtime(value, shown) if aware else value
    iso = value.isoformat(timespec="microseconds")
    millisecond = f".{local.microsecond // 1000:03d}"
    # One form everywhere, with the zone it is shown in (issue 37).
    zone = f" {local.tzname()}" if aware else ""
    text = f"{local.strftime('%Y-%m-%d %H:%M:%S')}{millisecond}{zone}"
    assert time_html(value, zone=shown) == f'<time datetime="{iso}" title="{iso}">{text}</time>'
    # The waterfall bar's tooltip takes the same form as plain text (issue 37).
    assert time_text(value, zone=shown) == text


def test_no_time_is_a_dash():
    assert time_html(None) == "—"
    assert time_text(None) == "—"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(value=json_values)
def test_pretty_json_is_the_standard_encoders_indented_form(value):
    expected = None if value in (None, "", [], {}) else json.dumps(value, ensure_ascii=False, indent=2, default=str)
    assert _pretty(value) == expected


@given(value=st.floats(allow_nan=False, allow_infinity=False) | st.integers(min_value=2**64))
def test_pretty_json_of_floats_and_huge_integers_reads_back_the_same(value):
    assert json.loads(_pretty({"v": value})) == {"v": value}


def test_model_names_wrap_only_between_their_parts_issue_37():
    from audit.templatetags.yx_admin import MODEL_PIECE_CHARS, model_html

    assert model_html("replay:tool_then_answer") == (
        '<span class="yx-model" title="replay:tool_then_answer">replay:<wbr>tool_then_answer</span>'
    )
    assert model_html("openai:gpt-4o-mini-2024-07-18") == (
        '<span class="yx-model" title="openai:gpt-4o-mini-2024-07-18">'
        "openai:<wbr>gpt-<wbr>4o-<wbr>mini-<wbr>2024-<wbr>07-<wbr>18</span>"
    )
    long = "acme:" + "x" * 40 + "<&>"
    assert model_html(long) == (
        f'<span class="yx-model" title="acme:{"x" * 40}&lt;&amp;&gt;">acme:<wbr>{"x" * (MODEL_PIECE_CHARS - 1)}…</span>'
    )
    assert model_html("plain") == '<span class="yx-model" title="plain">plain</span>'
