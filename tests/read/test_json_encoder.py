"""The API's JSON encoder (yuxi_project.responses, issue 11): orjson with
ninja's format, and the standard library where orjson refuses a value."""

from __future__ import annotations

import datetime as dt
import json
import uuid
import zoneinfo
from decimal import Decimal

import pytest
from ninja.responses import NinjaJSONEncoder

from audit.models import AgentRun
from yuxi_project.api import api
from yuxi_project.responses import RENDERER, encode_json

UTC = dt.UTC
SHANGHAI = zoneinfo.ZoneInfo("Asia/Shanghai")

VALUES = [
    {"at": dt.datetime(2026, 11, 30, 12, 1, 2, 345678, tzinfo=UTC)},  # to the millisecond, Z
    {"at": dt.datetime(2026, 11, 30, 12, 1, 2, tzinfo=UTC)},  # no fraction
    {"at": dt.datetime(2026, 11, 30, 12, 1, 2, 999, tzinfo=dt.UTC)},  # a fraction under 1 ms: ".000"
    {"at": dt.datetime(2026, 11, 30, 20, 1, 2, 5000, tzinfo=SHANGHAI)},  # an offset kept
    {"at": dt.datetime(2026, 11, 30, 12, 1, 2, 999)},  # naive
    {"day": dt.date(2026, 11, 30), "time": dt.time(7, 8, 9, 123456), "span": dt.timedelta(seconds=90)},
    {"usd": Decimal("0.000230000000"), "id": uuid.UUID("12345678-1234-5678-1234-567812345678")},
    {"status": AgentRun.Status.COMPLETED, "nested": [{"a": None, "b": True, "c": 1.5, "d": -7}]},
    {1: "int key", None: "null key"},
    {"text": 'é 中文 <b>&"quoted"</b> \\u0000 \x00 \U0001f600'},
    {"lone": "lone \ud83d surrogate"},  # orjson refuses: the standard library encodes it
    {"big": 2**70},  # above 64 bits: the standard library
]


@pytest.mark.parametrize("value", VALUES, ids=[str(i) for i in range(len(VALUES))])
def test_the_same_json_value_as_ninjas_encoder(value):
    ninja = json.loads(json.dumps(value, cls=NinjaJSONEncoder))
    assert json.loads(encode_json(value)) == ninja
    assert json.loads(RENDERER.render(None, value, response_status=200)) == ninja


def test_times_keep_the_millisecond_format_with_z():
    at = dt.datetime(2026, 11, 30, 12, 1, 2, 345678, tzinfo=UTC)
    assert encode_json({"at": at}) == b'{"at":"2026-11-30T12:01:02.345Z"}'


@pytest.mark.parametrize("microsecond", [0, 1, 999, 1000, 345678, 999999])
@pytest.mark.parametrize("zone", [UTC, SHANGHAI, None], ids=["utc", "shanghai", "naive"])
def test_times_are_written_as_djangos_encoder_writes_them(microsecond, zone):
    """The UTC fast path writes the very text of DjangoJSONEncoder."""
    at = dt.datetime(2026, 11, 30, 12, 1, 2, microsecond, tzinfo=zone)
    assert encode_json([at]) == json.dumps([at], cls=NinjaJSONEncoder, separators=(",", ":")).encode()


def test_a_value_no_encoder_knows_raises_type_error():
    with pytest.raises(TypeError):
        encode_json({"x": object()})


def test_the_api_renders_with_it():
    assert api.renderer is RENDERER
