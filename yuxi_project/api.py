"""The JSON API: wires the apps' routers and maps errors to HTTP in one place.

Every error body has the same shape: ``{"error": {"code", "message", ...}}``.
"""

from __future__ import annotations

from django.core.exceptions import RequestDataTooBig
from django.http import Http404
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, ValidationError

from core.errors import ApplicationError
from costs.budgets import BudgetExceeded

from .auth import api_auth
from .parser import CheckedJSONParser
from .responses import RENDERER

api = NinjaAPI(
    title="Agent run audit API",
    version="1",
    auth=api_auth,
    docs_url="/docs",
    urls_namespace="api",
    parser=CheckedJSONParser(),
    renderer=RENDERER,
)


def error_body(code: str, message: str, **extra) -> dict:
    return {"error": {"code": code, "message": message, **extra}}


@api.exception_handler(ApplicationError)
def _application_error(request, exc: ApplicationError):
    return api.create_response(request, error_body(exc.code, exc.message, **exc.extra), status=exc.http_status)


@api.exception_handler(BudgetExceeded)
def _budget_exceeded(request, exc: BudgetExceeded):
    # R-COST-3: the contract's flat 402 body, not the nested error shape.
    return api.create_response(request, exc.body(), status=exc.http_status)


@api.exception_handler(ValidationError)
def _validation_error(request, exc: ValidationError):
    return api.create_response(
        request, error_body("invalid_input", "the request is malformed", details=exc.errors), status=422
    )


@api.exception_handler(RequestDataTooBig)
def _too_big(request, exc):
    return api.create_response(
        request, error_body("payload_too_large", "the request body is larger than the server accepts"), status=413
    )


@api.exception_handler(AuthenticationError)
def _authentication_error(request, exc):
    return api.create_response(request, error_body("unauthenticated", "authentication required"), status=401)


@api.exception_handler(Http404)
def _not_found(request, exc):
    return api.create_response(request, error_body("not_found", "not found"), status=404)


@api.exception_handler(HttpError)
def _http_error(request, exc: HttpError):
    if isinstance(exc.__cause__, ApplicationError):
        # ninja wraps the parser's own refusals (NUL character, nesting).
        return _application_error(request, exc.__cause__)
    if exc.status_code == 400:
        # A body that is not JSON (ninja's "Cannot parse request body") is
        # malformed input like any other: one documented answer, 422 (R-READ-6).
        return api.create_response(request, error_body("invalid_input", str(exc)), status=422)
    return api.create_response(request, error_body("http_error", str(exc)), status=exc.status_code)


from audit.api import router as runs_router  # noqa: E402
from conversations.api import router as conversations_router  # noqa: E402
from dashboard.api import router as dashboard_router  # noqa: E402

api.add_router("/", conversations_router)
api.add_router("/", runs_router)
api.add_router("/", dashboard_router)
