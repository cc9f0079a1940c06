"""Parameter types shared by the API's schemas, each typed in the OpenAPI
document as tightly as the server checks it (R-READ-6).

A client generated from the schema then never sends what the server calls
malformed: a cursor has the cursor's alphabet, a run status list names only
statuses, a day lies in the range the dashboard accepts. Where the server's
own check gives a more useful error than pydantic would (``unknown run
status 'x'`` with the allowed values), the type only *documents* the rule
(:class:`~pydantic.WithJsonSchema`) and the server keeps its check.

What JSON Schema cannot say (``from`` at most 366 days before ``to``) is in
the parameter's description, and the server answers 422 naming the field.
"""

from __future__ import annotations

import zoneinfo
from datetime import date, datetime
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, WithJsonSchema


def _not_a_number(value: Any) -> Any:
    """Refuse a number where a date is expected: pydantic would read ``0``
    or ``"1700000000"`` as seconds since 1970 (``to=0``: a 1970 window)."""
    text = str(value).strip() if isinstance(value, int | float | str) else None
    if text is not None and text.lstrip("+-").replace(".", "", 1).isdigit():
        raise ValueError("must be an ISO 8601 date (YYYY-MM-DD) or time, not a number")
    return value


#: What each explained pattern means, in words: the 422 that refuses a
#: value says this instead of the regular expression (:func:`explained`).
PATTERN_MEANINGS: dict[str, str] = {}


def explained(pattern: str, meaning: str) -> str:
    """Return ``pattern``, recording ``meaning`` ("must not be blank") as
    what the API's 422 says of a value that does not match it
    (``yuxi_project.api``): a person reads the rule, not the expression."""
    PATTERN_MEANINGS[pattern] = meaning
    return pattern


def one_of_pattern(values) -> str:
    """A regular expression matching exactly one of ``values`` (plain words)."""
    return "(?:" + "|".join(values) + ")"


def comma_list_pattern(values, *, empty: bool = False) -> str:
    """``a``, ``a,b``, …: one or more of ``values`` separated by commas;
    with ``empty``, also ``""`` (a parameter given blank: no filter)."""
    one = one_of_pattern(values)
    return f"^(?:{one}(?:,{one})*)?$" if empty else f"^{one}(?:,{one})*$"


#: An ISO 8601 time (``2026-12-06T13:10:08Z``; naive = UTC); never a
#: number. Years 0002 to 9998: a time next to year 1 or 9999 may not move
#: into UTC (the server answers 422 ``out of range``).
IsoDateTime = Annotated[
    datetime,
    BeforeValidator(_not_a_number),
    WithJsonSchema(
        {
            "type": "string",
            "format": "date-time",
            "pattern": r"^(?:000[2-9]|00[1-9]\d|0[1-9]\d{2}|[1-8]\d{3}|9[0-8]\d{2}|99[0-8]\d)-",
        }
    ),
]

#: A calendar day ``YYYY-MM-DD``; never a number.
IsoDate = Annotated[date, BeforeValidator(_not_a_number)]

#: The dashboard's days: 1970-01-01 to 9000-12-31 (``dashboard.selectors``
#: ``EARLIEST_DAY``/``LATEST_DAY``), which the pattern bounds by year.
DashboardDay = Annotated[
    date,
    BeforeValidator(_not_a_number),
    WithJsonSchema({"type": "string", "format": "date", "pattern": r"^(?:19[7-9]\d|[2-8]\d{3}|9000)-\d{2}-\d{2}$"}),
]

#: An opaque paging cursor (a ``next_before`` the server issued):
#: URL-safe base64 without padding, never empty (an empty ``before=`` is a
#: malformed cursor, 422 ``bad_cursor``).
Cursor = Annotated[
    str,
    Field(max_length=500),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": 500, "pattern": r"^[A-Za-z0-9_-]+$"}),
]

#: A live-event sequence number, as the ``Last-Event-ID`` header carries it
#: (never empty: an EventSource with no id yet sends no header).
EVENT_ID_SCHEMA = {"type": "string", "pattern": r"^[0-9]{1,18}$"}

#: A non-negative USD amount as a decimal string: at most 9 digits before
#: the point and 9 after (``0.05``, ``12``).
USD_AMOUNT_SCHEMA = {"type": "string", "pattern": r"^[0-9]{1,9}(?:\.[0-9]{1,9})?$"}


def time_zone_schema() -> dict:
    """The IANA zone names the server accepts, as an enum."""
    return {"type": "string", "enum": sorted(zoneinfo.available_timezones())}
