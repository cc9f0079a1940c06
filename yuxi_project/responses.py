"""JSON answers built without a second validation pass (issue 11).

django-ninja validates a view's return value against the response schema
and dumps it again before encoding it; for a 500-row timeline that costs
several times the statement behind it. The large read endpoints build the
dict the schema would dump (same fields, same order, same Python values)
and return it through :func:`json_response`, which encodes it exactly as
ninja's renderer does, so the bytes are the same. Equality with the schema
path is tested per endpoint (``tests/read/test_fast_serialisation.py``).
"""

from __future__ import annotations

from typing import Any

from django.http import HttpResponse
from ninja.renderers import JSONRenderer

_RENDERER = JSONRenderer()
_CONTENT_TYPE = f"{_RENDERER.media_type}; charset={_RENDERER.charset}"


def json_response(data: dict[str, Any], *, status: int = 200) -> HttpResponse:
    """``data`` encoded as ninja encodes a response (``NinjaJSONEncoder``:
    times in ISO 8601 to the millisecond with ``Z``, UUIDs as strings),
    with ninja's content type. ``data`` must already be what the declared
    response schema dumps: nothing is validated here."""
    content = _RENDERER.render(None, data, response_status=status)
    return HttpResponse(content, status=status, content_type=_CONTENT_TYPE)
