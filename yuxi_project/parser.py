"""The API's request parser: JSON, with the limits PostgreSQL and the agent
runtime need enforced before any view runs (R-READ-6)."""

from __future__ import annotations

import json
import re
from typing import Any

from ninja.parser import Parser

from core.errors import InvalidInput

MAX_JSON_DEPTH = 32
# json.loads turns an unpaired \\uD800-\\uDFFF escape into a lone surrogate;
# a pair becomes one character above U+FFFF and never matches.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_payload(value: Any, *, where: str = "body", refuse_nul: bool = True) -> None:
    """Refuse what the runtime cannot handle: nesting deeper than
    :data:`MAX_JSON_DEPTH`, a lone surrogate (``\\ud800`` … ``\\udfff``
    escaped alone in the JSON) in any string or key, and with
    ``refuse_nul`` a NUL character in any string or key.

    This is the one input rule of every endpoint that takes text (turn
    input, title, feedback reason, resume args and message, R-RUN-13): a
    lone surrogate is not Unicode text, and a field that holds free JSON
    (resume edit args) would otherwise let one through that a string field
    refuses. A body may carry NUL characters: what is stored is escaped at
    the storage boundary (``core.storable``, R-RUN-11), so a user's text is
    kept as written. Query strings are never stored; a NUL there is
    refused.

    Raises :class:`InvalidInput` (422) naming the reason (``too_deep``,
    ``lone_surrogate``, ``nul_character``) and where (``path``: the keys
    and indexes down to the string); iterative, so a hostile document
    cannot exhaust the stack.
    """
    stack: list[tuple[Any, int, tuple]] = [(value, 1, ())]
    while stack:
        item, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidInput(
                f"the {where} is nested deeper than {MAX_JSON_DEPTH} levels", extra={"reason": "too_deep"}
            )
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                raise InvalidInput(
                    f"the {where} contains a lone surrogate, which is not Unicode text",
                    extra={"reason": "lone_surrogate", "path": list(path)},
                )
            if refuse_nul and "\x00" in item:
                raise InvalidInput(
                    f"the {where} contains a NUL character", extra={"reason": "nul_character", "path": list(path)}
                )
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, depth, path))
                stack.append((child, depth + 1, (*path, key)))
        elif isinstance(item, list):
            stack.extend((child, depth + 1, (*path, index)) for index, child in enumerate(item))


class CheckedJSONParser(Parser):
    def parse_body(self, request) -> dict[str, Any]:
        data = json.loads(request.body)
        check_payload(data, refuse_nul=False)
        return data

    def parse_querydict(self, data, list_fields, request) -> dict[str, Any]:
        result = super().parse_querydict(data, list_fields, request)
        check_payload(result, where="query")
        return result
