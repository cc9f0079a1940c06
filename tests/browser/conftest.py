"""Browser tests (R-ADM-1, R-DASH-1): Playwright drives Debian's Chromium
(``/usr/bin/chromium``, installed by ``bin/test``) against the real ASGI
server (uvicorn) on the test database. Screenshots are kept in
``test-artifacts/screenshots/``."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from tests.e2e.stack import ARTIFACTS, database_url_of, free_port, start_web
from tests.waiting import WAIT_SECONDS

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOTS = ARTIFACTS / "screenshots"


@pytest.fixture(scope="session")
def chromium_executable() -> str:
    if not CHROMIUM.exists():
        pytest.skip("browser tests need Debian's chromium at /usr/bin/chromium (apt-get install chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("browser tests need the 'playwright' Python package (test extras)")
    return str(CHROMIUM)


@pytest.fixture(scope="session")
def web_url(django_db_setup, django_db_blocker) -> str:
    """uvicorn serving the project on the test database (admin, API and
    static files through WhiteNoise)."""
    s = connection.settings_dict
    database_url = database_url_of(s)
    with django_db_blocker.unblock():
        own_backends = _backends_of(s["NAME"])
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "REDIS_URL": settings.CONFIG.REDIS_URL,
        "PYTHONUNBUFFERED": "1",
        "PYTHONWARNINGS": "ignore",
    }
    web = start_web("browser-web", port, env)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        web.stop()
        with django_db_blocker.unblock():
            _wait_for_backends_to_leave(s["NAME"], keep=own_backends)


def _backends_of(database: str) -> set[int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", [database])
        return {pid for (pid,) in cursor.fetchall()}


def _wait_for_backends_to_leave(database: str, *, keep: set[int], timeout: float = WAIT_SECONDS) -> None:
    """The server's connections end a moment after its process; the test
    database can only be dropped once they are gone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _backends_of(database) - keep - {connection_pid()}:
        time.sleep(0.1)


def connection_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


@pytest.fixture
def browser(chromium_executable, monkeypatch):
    from playwright.sync_api import sync_playwright

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    # Playwright's sync API runs an event loop in this thread; the test
    # builds its rows before and reads nothing from the ORM meanwhile.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_executable, args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()
