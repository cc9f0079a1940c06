"""The API's request parser: JSON, with the limits PostgreSQL and the agent
runtime need enforced before any view runs (R-READ-6)."""

from __future__ import annotations

import json
from typing import Any

from ninja.parser import Parser

from core.errors import InvalidInput

MAX_JSON_DEPTH = 32


def check_payload(value: Any, *, where: str = "body", refuse_nul: bool = True) -> None:
    """Refuse what the runtime cannot handle: nesting deeper than
    :data:`MAX_JSON_DEPTH`, and with ``refuse_nul`` a NUL character in any
    string or key.

    A body may carry NUL characters: what is stored is escaped at the
    storage boundary (``core.storable``, R-RUN-11), so a user's
    text is kept as written. Query strings are never stored; a NUL there is
    refused.

    Raises :class:`InvalidInput` (422) naming the reason; iterative, so a
    hostile document cannot exhaust the stack.
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidInput(
                f"the {where} is nested deeper than {MAX_JSON_DEPTH} levels", extra={"reason": "too_deep"}
            )
        if isinstance(item, str):
            if refuse_nul and "\x00" in item:
                raise InvalidInput(f"the {where} contains a NUL character", extra={"reason": "nul_character"})
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, depth))
                stack.append((child, depth + 1))
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)


class CheckedJSONParser(Parser):
    def parse_body(self, request) -> dict[str, Any]:
        data = json.loads(request.body)
        check_payload(data, refuse_nul=False)
        return data

    def parse_querydict(self, data, list_fields, request) -> dict[str, Any]:
        result = super().parse_querydict(data, list_fields, request)
        check_payload(result, where="query")
        return result
