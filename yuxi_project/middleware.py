"""Every answer under ``/api/`` is JSON, also when no route matched.

Django answers a path that no URL pattern matches with its HTML 404 page,
and django-ninja a known path with an unsupported method with an empty
``405``. API clients parse the error shape of :mod:`yuxi_project.api`
(``{"error": {"code", "message", ...}}``) instead; this middleware gives
them that shape for every non-JSON 404 and 405 under ``/api/``, keeping
the ``Allow`` header of a 405.
"""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction
from django.http import JsonResponse
from django.utils.decorators import sync_and_async_middleware


@sync_and_async_middleware
def ApiJsonErrorsMiddleware(get_response):  # noqa: N802 (a middleware factory, named like a class)
    """Turn non-JSON 404 / 405 answers under ``/api/`` into the API's JSON
    error shape (``code`` ``not_found`` / ``method_not_allowed``). Async
    capable, so the live event stream stays an async view under ASGI."""
    if iscoroutinefunction(get_response):

        async def middleware(request):
            return _checked(request, await get_response(request))

    else:

        def middleware(request):
            return _checked(request, get_response(request))

    return middleware


def _checked(request, response):
    if (
        response.status_code in (404, 405)
        and request.path.startswith("/api/")
        and not response.get("Content-Type", "").startswith("application/json")
    ):
        return json_error(request, response)
    return response


def json_error(request, response) -> JsonResponse:
    if response.status_code == 404:
        body = {"error": {"code": "not_found", "message": f"no API endpoint at {request.path}"}}
        return JsonResponse(body, status=404)
    allowed = [m.strip() for m in response.get("Allow", "").split(",") if m.strip()]
    body = {
        "error": {
            "code": "method_not_allowed",
            "message": f"{request.method} is not allowed on {request.path}",
            "allowed": allowed,
        }
    }
    answer = JsonResponse(body, status=405)
    if allowed:
        answer["Allow"] = ", ".join(allowed)
    return answer
