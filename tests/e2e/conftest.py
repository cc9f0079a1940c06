from __future__ import annotations

import pytest
from django.conf import settings
from django.db import connection

from .stack import start_stack


@pytest.fixture(scope="session")
def e2e_database_url(django_db_setup) -> str:
    """The URL of the test database the processes must use."""
    s = connection.settings_dict
    user = s.get("USER") or ""
    password = f":{s['PASSWORD']}" if s.get("PASSWORD") else ""
    auth = f"{user}{password}@" if user else ""
    host = s.get("HOST") or "127.0.0.1"
    port = s.get("PORT") or 5432
    return f"postgres://{auth}{host}:{port}/{s['NAME']}"


@pytest.fixture(scope="session")
def stack(e2e_database_url, django_db_blocker):
    """Replay server + ASGI web server + one Celery worker for the session."""
    stack = start_stack(database_url=e2e_database_url, redis_url=settings.CONFIG.REDIS_URL)
    yield stack
    stack.stop()
