"""Opaque keyset cursors for paging back through ordered rows.

A cursor is the sort key of the oldest row of the page the client holds,
encoded as URL-safe base64 JSON. Readers compare rows to it with
:func:`before_key` (keyset pagination: no OFFSET, stable while rows are
appended at the end).
"""

from __future__ import annotations

import base64
import json
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
