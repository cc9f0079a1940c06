from __future__ import annotations

import pytest
from django.conf import settings
from django.db import connection

from .stack import database_url_of, start_stack


@pytest.fixture(scope="session")
def e2e_database_url(django_db_setup) -> str:
    """The URL of the test database the processes must use."""
    return database_url_of(connection.settings_dict)


@pytest.fixture(scope="package")
def stack(e2e_database_url, django_db_blocker):
    """Replay server + ASGI web server + one Celery worker for the tests of
    this package. Stopped when they are done: its worker's beat (the
    sweeper and the dispatcher, every second) locks and writes rows of the
    test database and would hand the runs later tests leave pending to its
    worker; the later tests must own the database alone (a beat
    transaction held the OTel export horizon of tests/otel back)."""
    stack = start_stack(database_url=e2e_database_url, redis_url=settings.CONFIG.REDIS_URL)
    yield stack
    stack.stop()
