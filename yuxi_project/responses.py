"""JSON answers of the API: one encoder for every response, and large
answers built without a second validation pass (issue 11).

:class:`FastJSONRenderer` is the API's renderer (``NinjaAPI(renderer=…)``):
it encodes with orjson, whose output is the same JSON value as ninja's
``NinjaJSONEncoder`` gives — times in ISO 8601 to the millisecond with
``Z`` (Django's format, kept through orjson's datetime passthrough),
decimals and UUIDs as strings — written compactly and in UTF-8. A value
orjson refuses (a lone surrogate, an integer above 64 bits) falls back to
the standard library encoder with the same format, ASCII-escaped, so every
answer ninja could encode is still encoded.

django-ninja validates a view's return value against the response schema
and dumps it again before encoding it; for a 500-row timeline that costs
several times the statement behind it. The large read endpoints build the
dict the schema would dump (same fields, same order, same Python values)
and return it through :func:`json_response`, which encodes it with the same
renderer, so the bytes are the same. Equality with the schema path is
tested per endpoint (``tests/read/test_fast_serialisation.py``).
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import orjson
from django.core.serializers.json import DjangoJSONEncoder
from django.http import HttpResponse
from ninja.renderers import JSONRenderer
from ninja.responses import NinjaJSONEncoder

_ENCODER = NinjaJSONEncoder()
_OPTIONS = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_NON_STR_KEYS


def _default(value: Any) -> Any:
    if type(value) is dt.datetime:  # the common case first: Django's own format
        if value.tzinfo is dt.UTC:
            # What DjangoJSONEncoder writes for a UTC time, without its
            # slicing (a 500-row timeline has a thousand of them): the
            # fraction cut to milliseconds, none when zero, and "Z".
            return value.isoformat("T", "milliseconds" if value.microsecond else "seconds")[:-6] + "Z"
        return DjangoJSONEncoder.default(_ENCODER, value)
    return _ENCODER.default(value)


def encode_json(data: Any) -> bytes:
    """``data`` as JSON bytes (UTF-8), in the format described in the
    module docstring. Raises ``TypeError`` for a value neither encoder
    knows (as ninja's encoder does)."""
    try:
        return orjson.dumps(data, default=_default, option=_OPTIONS)
    except orjson.JSONEncodeError:
        return json.dumps(data, cls=NinjaJSONEncoder, separators=(",", ":")).encode()


class FastJSONRenderer(JSONRenderer):
    """ninja's JSON renderer, encoding with :func:`encode_json`."""

    def render(self, request, data: Any, *, response_status: int) -> bytes:
        return encode_json(data)


RENDERER = FastJSONRenderer()
_CONTENT_TYPE = f"{RENDERER.media_type}; charset={RENDERER.charset}"


def json_response(data: dict[str, Any], *, status: int = 200) -> HttpResponse:
    """``data`` encoded as the API encodes every response
    (:class:`FastJSONRenderer`), with its content type. ``data`` must
    already be what the declared response schema dumps: nothing is
    validated here."""
    return HttpResponse(encode_json(data), status=status, content_type=_CONTENT_TYPE)
