"""Readiness: can this deployment take runs now? (R-OPS-1)

:func:`readiness` checks, within ``READYZ_TIMEOUT_SECONDS`` in all:

* ``database``: PostgreSQL answers ``SELECT 1``;
* ``migrations``: the schema matches the code — the schema guard's own
  findings (:func:`yuxi_project.schema_guard.schema_problems`: unapplied or
  unknown migrations, the retired table);
* ``redis``: the broker and event store answers ``PING``;
* ``worker``: at least one Celery worker answers a broadcast ``ping``
  (asked only when Redis answered; the first reply ends the wait).

The database pair and the Redis pair run in two threads at once; a check
still running at the deadline counts as down (``timed out``). Under the
embedded defaults (no Redis) ``redis`` and ``worker`` report the in-process
worker and pass.

Why not django-health-check: its view answers 500, not the 503 this
contract names, and of its checks only the database and Redis ones would be
used — the migration check must be the schema guard's stricter rules, and
the worker check has to wait for the Redis check and skip under the
embedded defaults. A small view with the two threads and one deadline is
shorter than the plugins and overrides it would take.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
from django.db import connection

from core.config import get_config
from yuxi_project.celery import app as celery_app
from yuxi_project.schema_guard import schema_problems

CHECKS = ("database", "migrations", "redis", "worker")


@dataclass
class CheckResult:
    ok: bool
    detail: str = ""
    ms: float | None = None

    def as_json(self) -> dict:
        body: dict = {"ok": self.ok}
        if self.detail:
            body["detail"] = self.detail
        if self.ms is not None:
            body["ms"] = round(self.ms, 1)
        return body


@dataclass
class Readiness:
    checks: dict[str, CheckResult] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return all(result.ok for result in self.checks.values())

    @property
    def down(self) -> list[str]:
        return [name for name in CHECKS if name in self.checks and not self.checks[name].ok]

    def as_json(self) -> dict:
        return {
            "status": "ok" if self.ready else "unavailable",
            "down": self.down,
            "checks": {name: result.as_json() for name, result in self.checks.items()},
        }


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__


def _timed(check: Callable[[], str]) -> CheckResult:
    began = time.perf_counter()
    try:
        detail = check()
    except Exception as exc:
        return CheckResult(False, _describe(exc), (time.perf_counter() - began) * 1000)
    return CheckResult(True, detail, (time.perf_counter() - began) * 1000)


def check_database() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()
    return ""


def check_migrations() -> str:
    problems = schema_problems()
    if problems:
        raise RuntimeError("; ".join(problems))
    return ""


def check_redis(url: str, timeout: float) -> str:
    client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        client.ping()
    finally:
        client.close()
    return ""


def check_worker(timeout: float) -> str:
    replies = celery_app.control.ping(timeout=timeout, limit=1)
    if not replies:
        raise RuntimeError(f"no Celery worker answered a ping within {timeout:g}s")
    return ", ".join(sorted(name for reply in replies for name in reply))


def _database_pair(results: dict[str, CheckResult]) -> None:
    try:
        results["database"] = _timed(check_database)
        if results["database"].ok:
            results["migrations"] = _timed(check_migrations)
        else:
            results["migrations"] = CheckResult(False, "not checked: the database is down")
    finally:
        connection.close()


def _redis_pair(results: dict[str, CheckResult], timeout: float) -> None:
    url = get_config().REDIS_URL
    if not url:
        results["redis"] = CheckResult(True, "not configured: embedded defaults")
        results["worker"] = CheckResult(True, "in-process worker (embedded defaults)")
        return
    results["redis"] = _timed(lambda: check_redis(url, timeout / 2))
    if results["redis"].ok:
        results["worker"] = _timed(lambda: check_worker(timeout / 2))
    else:
        results["worker"] = CheckResult(False, "not checked: Redis is down")


# One probe at a time per process, and a result is reused for a second: the
# endpoint is open to anonymous callers, and a flood of probes must not take
# the database pool's connections from the API.
_probe_lock = threading.Lock()
_last: tuple[float, Readiness] | None = None
REUSE_SECONDS = 1.0


def readiness(timeout: float | None = None) -> Readiness:
    """The current readiness: a result younger than ``REUSE_SECONDS``, or a
    new probe (:func:`probe`). Concurrent callers wait for the one probe in
    flight (at most ``timeout`` seconds). Never raises."""
    global _last
    timeout = timeout or get_config().READYZ_TIMEOUT_SECONDS
    if not _probe_lock.acquire(timeout=timeout):
        return _last[1] if _last else _all_down(f"timed out after {timeout:g}s waiting for another probe")
    try:
        if _last is not None and time.monotonic() - _last[0] < REUSE_SECONDS:
            return _last[1]
        report = probe(timeout)
        _last = (time.monotonic(), report)
        return report
    finally:
        _probe_lock.release()


def _all_down(detail: str) -> Readiness:
    return Readiness({name: CheckResult(False, detail) for name in CHECKS})


def probe(timeout: float) -> Readiness:
    """Run the four checks at once, each pair in its own thread; anything
    unanswered after ``timeout`` seconds counts as down. Never raises."""
    results: dict[str, CheckResult] = {}
    threads = [
        threading.Thread(target=_database_pair, args=(results,), daemon=True, name="readyz-database"),
        threading.Thread(target=_redis_pair, args=(results, timeout), daemon=True, name="readyz-redis"),
    ]
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    report = Readiness()
    for name in CHECKS:
        # A copy: a late thread may still write into ``results``.
        report.checks[name] = results.get(name) or CheckResult(False, f"timed out after {timeout:g}s")
    return report
