"""Opaque keyset cursors for paging back through ordered rows.

A cursor is the sort key of the oldest row of the page the client holds,
encoded as URL-safe base64 JSON. Readers compare rows to it with
:func:`before_key` (keyset pagination: no OFFSET, stable while rows are
appended at the end).
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import uuid
from typing import Any

from django.db.models import Q

from .errors import InvalidInput


def encode_cursor(key: list[Any]) -> str:
    """``key`` is a list of JSON-able values (datetimes as ISO strings)."""
    raw = json.dumps(key, separators=(",", ":"), default=str).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, *, length: int) -> list[Any]:
    """The key inside ``cursor``; raises :class:`InvalidInput` (422,
    ``reason: bad_cursor``) when it is not one this module made with a key
    of ``length`` values."""
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        key = json.loads(base64.urlsafe_b64decode(padded.encode()).decode())
    except (ValueError, UnicodeError) as exc:
        raise InvalidInput("the cursor is malformed", extra={"reason": "bad_cursor"}) from exc
    if not isinstance(key, list) or len(key) != length:
        raise InvalidInput("the cursor is malformed", extra={"reason": "bad_cursor"})
    return key


def before_key(fields: list[str], values: list[Any]) -> Q:
    """Rows whose ``(fields...)`` tuple sorts strictly before ``values``
    (ascending order on every field): a keyset predicate built from Q
    objects, because the ORM has no row-value comparison."""
    condition = Q(pk__in=[])
    for i, name in enumerate(fields):
        step = Q(**{f"{name}__lt": values[i]})
        for prior_name, prior_value in zip(fields[:i], values[:i], strict=True):
            step &= Q(**{prior_name: prior_value})
        condition |= step
    return condition


def _datetime(value: Any) -> dt.datetime:
    """An aware datetime, normalised to UTC so that no offset PostgreSQL
    refuses reaches the query; OverflowError past year 9999."""
    if not isinstance(value, str):
        _bad()
    parsed = dt.datetime.fromisoformat(value)
    if parsed.tzinfo is None:
        _bad()
    return parsed.astimezone(dt.UTC)


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not -(2**63) < value < 2**63:
        _bad()
    return value


_PARSERS = {
    "datetime": _datetime,
    "uuid": lambda v: uuid.UUID(v) if isinstance(v, str) else _bad(),
    "int": _int,
}


def _bad():
    raise ValueError("wrong type")


def _dump(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def parse_cursor(cursor: str, key: list[tuple[str, str]]) -> list[Any]:
    """The values of a cursor made by :func:`page_cursor` for ``key``
    (``[(field, kind)]``), parsed to their kinds (aware datetimes in UTC,
    UUIDs, ints).

    Raises :class:`InvalidInput` (``reason: bad_cursor``) for a cursor that
    does not decode to such a key."""
    raw = decode_cursor(cursor, length=len(key))
    try:
        return [_PARSERS[kind](value) for (_, kind), value in zip(key, raw, strict=True)]
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidInput("the cursor is malformed", extra={"reason": "bad_cursor"}) from exc


def page_cursor(row: Any, key: list[tuple[str, str]]) -> str:
    """The cursor of ``row``: its ``key`` attributes, encoded."""
    return encode_cursor([_dump(getattr(row, name)) for name, _ in key])


def keyset_page(rows, *, key: list[tuple[str, str]], limit: int, before: str | None) -> tuple[list, bool, str | None]:
    """The newest ``limit`` rows of ``rows`` in ascending ``key`` order,
    optionally only those before the cursor ``before``.

    ``key`` is ``[(field, kind)]`` with kind ``datetime``, ``uuid`` or
    ``int``; the fields (annotations allowed) must make a total order.
    Returns ``(items, more, next_before)``: ``more`` is true when older rows
    exist and ``next_before`` is then the cursor to them.

    Raises :class:`InvalidInput` (``reason: bad_cursor``) for a cursor that
    does not decode to such a key. Two fetches at most: no OFFSET.
    """
    names = [name for name, _ in key]
    if before is not None:
        rows = rows.filter(before_key(names, parse_cursor(before, key)))
    newest_first = list(rows.order_by(*(f"-{name}" for name in names))[: limit + 1])
    more = len(newest_first) > limit
    items = newest_first[:limit][::-1]
    next_before = page_cursor(items[0], key) if more else None
    return items, more, next_before
