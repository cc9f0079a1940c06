"""``/metrics`` access, ``/healthz``, ``/readyz`` naming what is down, and
the ids on log lines (R-OPS-1). In-process: Django's test client on the
real database; readiness with a healthy Redis and worker, and Redis stopped
and restarted, is in ``tests/e2e/test_operations.py``."""

from __future__ import annotations

import asyncio
import contextvars
import io
import json
import logging

import pytest
from django.db import connection
from django.http import HttpResponse
from django.test import RequestFactory

from core.config import get_config
from ops import health, logcontext
from ops.middleware import RequestContextMiddleware
from tests.conftest import bearer
from tests.e2e.stack import free_port

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fresh_probe(monkeypatch):
    """Each test probes anew (a probe's result is reused for a second)."""
    monkeypatch.setattr(health, "_last", None)


# --------------------------------------------------------------------------
# /metrics access
# --------------------------------------------------------------------------


def test_metrics_are_never_anonymous_R_OPS_1(client):
    response = client.get("/metrics")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "unauthenticated"
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Basic abc").status_code == 401


def test_metrics_answer_the_scrape_token_and_refuse_a_wrong_one_R_OPS_1(client, monkeypatch):
    monkeypatch.setattr(get_config(), "METRICS_TOKEN", "scrape-secret-1")
    ok = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret-1")
    assert ok.status_code == 200
    assert ok["Content-Type"].startswith("text/plain")
    assert b"yuxi_runs_pending" in ok.content and b"yuxi_audit_write_duration_seconds" in ok.content
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret-2").status_code == 401
    assert client.post("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret-1").status_code == 405


def test_no_token_configured_means_no_token_matches_R_OPS_1(client, monkeypatch):
    monkeypatch.setattr(get_config(), "METRICS_TOKEN", "")
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer x").status_code == 401


def test_metrics_answer_staff_sessions_and_staff_api_tokens_only_R_OPS_1(client, user, staff_user):
    assert client.get("/metrics", **_auth(bearer(user))).status_code == 403
    assert client.get("/metrics", **_auth(bearer(staff_user))).status_code == 200
    client.force_login(user)
    assert client.get("/metrics").status_code == 403
    client.force_login(staff_user)
    assert client.get("/metrics").status_code == 200


def _auth(headers: dict[str, str]) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": headers["Authorization"]}


# --------------------------------------------------------------------------
# /healthz, /readyz
# --------------------------------------------------------------------------


def test_healthz_answers_without_credentials_R_OPS_1(client):
    response = client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}
    assert client.head("/healthz").status_code == 200  # load balancers probe with HEAD too
    assert client.post("/healthz").status_code == 405


def test_readyz_names_redis_and_the_worker_when_redis_does_not_answer_R_OPS_1(client, monkeypatch):
    closed = free_port()
    monkeypatch.setattr(get_config(), "REDIS_URL", f"redis://127.0.0.1:{closed}/0")
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable"
    assert body["down"] == ["redis", "worker"]
    assert body["checks"]["database"]["ok"] and body["checks"]["migrations"]["ok"]
    assert "ConnectionError" in body["checks"]["redis"]["detail"]
    assert body["checks"]["worker"]["detail"] == "not checked: Redis is down"


def test_readyz_names_the_worker_when_no_worker_answers_the_ping_R_OPS_1(client):
    """Issue 35: a worker check that passed without a reply survived the
    suite. The tests' broker is their own Redis database, which no worker
    consumes: the broadcast ping goes out for real and nobody answers."""
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert "worker" in body["down"] and body["checks"]["redis"]["ok"]
    assert body["checks"]["worker"]["detail"].startswith("RuntimeError: no Celery worker answered a ping")


@pytest.mark.django_db(transaction=True)
def test_readyz_names_the_migrations_when_the_schema_guard_objects_R_OPS_1(client, monkeypatch):
    monkeypatch.setattr(get_config(), "REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO django_migrations (app, name, applied) VALUES ('audit', '9999_from_the_future', now())"
        )
    try:
        body = client.get("/readyz").json()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DELETE FROM django_migrations WHERE name = '9999_from_the_future'")
    assert "migrations" in body["down"]
    assert "audit.9999_from_the_future" in body["checks"]["migrations"]["detail"]
    assert body["checks"]["database"]["ok"]


def test_concurrent_probes_share_one_probe_and_reuse_it_for_a_second_R_OPS_1(monkeypatch):
    import threading

    monkeypatch.setattr(get_config(), "REDIS_URL", "")
    reports = []
    callers = [threading.Thread(target=lambda: reports.append(health.readiness())) for _ in range(8)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(reports) == 8 and all(report is reports[0] for report in reports)
    monkeypatch.setattr(health, "_last", (health._last[0] - health.REUSE_SECONDS, health._last[1]))
    assert health.readiness() is not reports[0]


def test_readyz_passes_redis_and_worker_under_the_embedded_defaults_R_OPS_1(client, monkeypatch):
    monkeypatch.setattr(get_config(), "REDIS_URL", "")
    response = client.get("/readyz")
    assert response.status_code == 200, response.json()
    assert response.json()["down"] == []
    assert "embedded" in response.json()["checks"]["redis"]["detail"]


# --------------------------------------------------------------------------
# Request ids and log lines
# --------------------------------------------------------------------------


def test_each_response_names_its_request_id_and_keeps_a_plain_one_from_the_caller_R_OPS_1(client):
    mine = client.get("/healthz", HTTP_X_REQUEST_ID="lb-1234.abc:9")
    assert mine["X-Request-ID"] == "lb-1234.abc:9"
    generated = client.get("/healthz")
    other = client.get("/healthz")
    assert len(generated["X-Request-ID"]) == 32 and generated["X-Request-ID"] != other["X-Request-ID"]
    for hostile in ("a b", "x" * 129, "id\nforged line", '{"json":1}'):
        replaced = client.get("/healthz", HTTP_X_REQUEST_ID=hostile)["X-Request-ID"]
        assert replaced != hostile and len(replaced) == 32


def _json_handler() -> tuple[logging.Handler, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(logcontext.ContextFilter())
    handler.setFormatter(logcontext.json_formatter())
    return handler, stream


def _lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_inside_a_request_carry_its_request_run_and_thread_ids_R_OPS_1():
    handler, stream = _json_handler()
    logger = logging.getLogger("tests.ops.request")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

    def view(request, run_id):
        logger.info("inside the view")
        return HttpResponse("ok")

    def get_response(request):
        middleware.process_view(request, view, (), {"run_id": "run-1"})
        return view(request, run_id="run-1")

    async def aget_response(request):
        middleware_async.process_view(request, view, (), {"thread_id": "thread-9"})
        logger.info("inside the async view")
        return HttpResponse("ok")

    try:
        middleware = RequestContextMiddleware(get_response)
        request = RequestFactory().get("/x", HTTP_X_REQUEST_ID="req-1")
        # A server thread's own context, as under runserver or an ASGI thread.
        assert contextvars.copy_context().run(middleware, request)["X-Request-ID"] == "req-1"
        middleware_async = RequestContextMiddleware(aget_response)
        response = asyncio.run(middleware_async(RequestFactory().get("/y", HTTP_X_REQUEST_ID="req-2")))
        assert response["X-Request-ID"] == "req-2"
    finally:
        logger.removeHandler(handler)
    sync_line, async_line = _lines(stream)
    assert sync_line["message"] == "inside the view"
    assert (sync_line["request_id"], sync_line["run_id"], sync_line["thread_id"]) == ("req-1", "run-1", None)
    assert (async_line["request_id"], async_line["thread_id"], async_line["run_id"]) == ("req-2", "thread-9", None)
    for line in (sync_line, async_line):
        assert set(line) >= {"time", "level", "logger", "message", "run_id", "thread_id", "request_id", "worker"}
        assert line["worker"] == logcontext.process_identity()


def test_json_lines_inside_a_run_carry_run_thread_and_worker_and_nothing_leaks_after_R_OPS_1():
    handler, stream = _json_handler()
    logger = logging.getLogger("tests.ops.run")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with logcontext.scope(run_id="r-1"):
            logcontext.bind(thread_id="t-1", worker="host:1:abc")

            async def in_the_run():
                await asyncio.sleep(0)
                logger.info("in a task of the run")

            asyncio.run(in_the_run())
            logger.warning("with %s", "args", extra={"request_id": "explicit"})
        logger.info("after the run")
    finally:
        logger.removeHandler(handler)
    in_run, explicit, after = _lines(stream)
    assert (in_run["run_id"], in_run["thread_id"], in_run["worker"]) == ("r-1", "t-1", "host:1:abc")
    assert explicit["message"] == "with args" and explicit["request_id"] == "explicit"
    assert after["run_id"] is None and after["thread_id"] is None
    assert after["worker"] == logcontext.process_identity()


def test_the_log_format_setting_is_validated_R_OPS_1(monkeypatch):
    from core.config import Config

    monkeypatch.delenv("LOG_FORMAT", raising=False)
    assert Config().LOG_FORMAT == "plain"  # human-readable unless asked
    monkeypatch.setenv("LOG_FORMAT", "JSON")
    assert Config().LOG_FORMAT == "json"
    monkeypatch.setenv("LOG_FORMAT", "xml")
    with pytest.raises(ValueError):
        Config()
    monkeypatch.setenv("LOG_FORMAT", "plain")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/nonexistent/prometheus-dir")
    with pytest.raises(ValueError, match="PROMETHEUS_MULTIPROC_DIR"):
        Config()
