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

from .api_types import PATTERN_MEANINGS
from .auth import api_auth
from .parser import CheckedJSONParser
from .responses import RENDERER

API_DESCRIPTION = """\
Threads, runs, history, live events and feedback for the signed-in user;
audit timelines, run search and exports, and dashboards for staff.

Authentication: `Authorization: Bearer <token>` (a per-user API token), or
the Django session cookie. With the session, every `POST` and `PATCH` also needs
Django's CSRF token in the `X-CSRFToken` header, else 403 `csrf_failed`.

Every error answer has one shape, `{"error": {"code", "message", ...}}`,
also where no operation matched: an unknown path under `/api/` is 404
`not_found`, a method a path does not offer is 405 `method_not_allowed`
with the offered methods in `allowed` and in the `Allow` header.
"""

#: Methods Django's CSRF check applies to (session authentication only).
UNSAFE_METHODS = ("post", "put", "patch", "delete")


#: A query string never carries a NUL character (``parser.check_payload``).
NO_NUL_PATTERN = r"^[^\u0000]*$"


def _without_nul(schema: dict) -> None:
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") == "string" and not {"pattern", "enum", "format"} & branch.keys():
            branch["pattern"] = NO_NUL_PATTERN


class AuditAPI(NinjaAPI):
    def get_openapi_schema(self, *, path_prefix=None, path_params=None):
        """ninja's document, plus two rules that apply before any operation
        runs, so that no operation's own schema can state them: free text
        in a query string has no NUL character (the parser refuses one),
        and every unsafe operation may answer the CSRF check's 403 (it runs
        in the session authentication)."""
        schema = super().get_openapi_schema(path_prefix=path_prefix, path_params=path_params)
        error = {"$ref": "#/components/schemas/ErrorOut"}
        for operations in schema["paths"].values():
            for method, operation in operations.items():
                for parameter in operation.get("parameters", []):
                    if parameter["in"] == "query":
                        _without_nul(parameter["schema"])
                if method in UNSAFE_METHODS:
                    operation["responses"].setdefault(
                        403,
                        {
                            "description": "Session authentication without a valid CSRF token (`csrf_failed`).",
                            "content": {"application/json": {"schema": error}},
                        },
                    )
        return schema

    def get_openapi_operation_id(self, operation) -> str:
        """``listRuns`` for ``list_runs``: the view's name in camelCase, the
        name a generated client gives the call (ninja's default prefixes
        the Python module: ``audit_api_list_runs``). Names are unique across
        the routers (tests/read/test_openapi_contract.py)."""
        head, *rest = operation.view_func.__name__.split("_")
        return head + "".join(word.capitalize() for word in rest)


api = AuditAPI(
    title="Agent run audit API",
    version="1",
    description=API_DESCRIPTION,
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
    details = [_explained(error) for error in exc.errors]
    message = "the request is malformed"
    if details:
        first = details[0]
        message += f": {_field_of(first.get('loc', ()))}{first.get('msg', 'invalid')}"
        if len(details) > 1:
            message += f" (and {len(details) - 1} more in details)"
    return api.create_response(request, error_body("invalid_input", message, details=details), status=422)


def _explained(error: dict) -> dict:
    """``error`` with the words of its pattern (``api_types.explained``) in
    place of pydantic's "String should match pattern '…'"."""
    if error.get("type") == "string_pattern_mismatch":
        meaning = PATTERN_MEANINGS.get((error.get("ctx") or {}).get("pattern"))
        if meaning:
            return {**error, "msg": meaning}
    return error


def _field_of(loc) -> str:
    """``"title: "`` for ``["body", "payload", "title"]`` (ninja puts the
    view's parameter name after ``body``), ``"limit: "`` for ``["query",
    "limit"]``; ``""`` for the body as a whole."""
    loc = [str(part) for part in loc]
    skip = 2 if loc[:1] == ["body"] else 1
    return ".".join(loc[skip:]) + ": " if loc[skip:] else ""


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
    if exc.status_code == 403 and str(exc) == "CSRF check Failed":
        # ninja's session authentication refusing an unsafe request.
        return api.create_response(
            request,
            error_body("csrf_failed", "the session's CSRF token is missing or wrong (send it as X-CSRFToken)"),
            status=403,
        )
    return api.create_response(request, error_body("http_error", str(exc)), status=exc.status_code)


from audit.api import router as runs_router  # noqa: E402
from conversations.api import router as conversations_router  # noqa: E402
from dashboard.api import router as dashboard_router  # noqa: E402

api.add_router("/", conversations_router)
api.add_router("/", runs_router)
api.add_router("/", dashboard_router)
