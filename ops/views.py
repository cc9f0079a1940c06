"""``GET /metrics``, ``GET /healthz``, ``GET /readyz`` (R-OPS-1).

``/metrics`` is never anonymous: it answers a scraper that sends
``Authorization: Bearer <METRICS_TOKEN>``, a staff user's API token, or a
staff session; 401 (403 for a signed-in non-staff user) otherwise, with the
API's error body. ``/healthz`` and ``/readyz`` are open — probes carry no
credentials — and say only which component is down.
"""

from __future__ import annotations

import hmac

from django.http import HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_safe
from prometheus_client import CONTENT_TYPE_LATEST

from core.config import get_config

from .exposition import render
from .health import readiness


def _error(status: int, code: str, message: str) -> JsonResponse:
    response = JsonResponse({"error": {"code": code, "message": message}}, status=status)
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response


def _metrics_caller_status(request) -> int:
    """200 when the caller may scrape, else 401 or 403."""
    header = request.headers.get("Authorization", "")
    scheme, _, supplied = header.partition(" ")
    supplied = supplied.strip()
    if scheme.lower() == "bearer" and supplied:
        token = get_config().METRICS_TOKEN
        if token and hmac.compare_digest(supplied.encode(), token.encode()):
            return 200
        from yuxi_project.auth import BearerTokenAuth

        user = BearerTokenAuth().authenticate(request, supplied)
        if user is None:
            return 401
        return 200 if user.is_staff else 403
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated or not user.is_active:
        return 401
    return 200 if user.is_staff else 403


@never_cache
@require_GET
def metrics_view(request):
    """The Prometheus exposition of the web and worker processes plus the
    queue gauges (R-OPS-1)."""
    status = _metrics_caller_status(request)
    if status == 401:
        return _error(401, "unauthenticated", "send Authorization: Bearer <METRICS_TOKEN> or sign in as staff")
    if status == 403:
        return _error(403, "permission_denied", "metrics are for staff")
    return HttpResponse(render(), content_type=CONTENT_TYPE_LATEST)


@never_cache
@require_safe
def healthz(request):
    """Liveness: the process answers. Touches nothing else."""
    return JsonResponse({"status": "ok"})


@never_cache
@require_safe
def readyz(request):
    """Readiness: 200 when PostgreSQL, the migrations, Redis and a Celery
    worker are all fine, else 503; the body names what is down
    (``{"status", "down": [...], "checks": {name: {ok, detail?, ms?}}}``)."""
    report = readiness()
    return JsonResponse(report.as_json(), status=200 if report.ready else 503)
