"""R-SCH-1: web and worker refuse to start against a database whose schema
is not this code's, with a message that says what to do.

The process tests use a real scratch PostgreSQL database that still has the
retired ``tool_calls`` table and no migrations."""

from __future__ import annotations

import os
import subprocess
import sys

import psycopg
import pytest
from django.db import connection

from yuxi_project.schema_guard import SchemaMismatch, ensure_schema_matches, schema_problems

from .stack import REPO, free_port

pytestmark = pytest.mark.django_db


def test_the_migrated_test_database_passes_R_SCH_1():
    assert schema_problems() == []


def test_legacy_tool_calls_table_is_refused_R_SCH_1():
    # DDL is transactional in PostgreSQL: the test's transaction rolls it back.
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE tool_calls (id bigserial primary key, tool_call_id text)")
    [problem] = schema_problems()
    assert "tool_calls" in problem and "DROP TABLE tool_calls" in problem
    with pytest.raises(SchemaMismatch, match="tool_calls"):
        ensure_schema_matches()


def test_applied_migration_unknown_to_the_code_is_refused_R_SCH_1():
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO django_migrations (app, name, applied) VALUES ('audit', '9999_from_the_future', now())"
        )
    [problem] = schema_problems()
    assert "audit.9999_from_the_future" in problem and "another version" in problem


def test_unapplied_migration_is_refused_R_SCH_1():
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM django_migrations WHERE app = 'audit' AND name = '0003_langgraph_checkpointer'")
    [problem] = schema_problems()
    assert "audit.0003_langgraph_checkpointer" in problem and "manage.py migrate" in problem


@pytest.fixture
def legacy_database(db_name):
    """A scratch database with only the retired ``tool_calls`` table."""
    settings = connection.settings_dict
    name = f"{db_name}_legacy_guard"
    admin = psycopg.connect(
        host=settings.get("HOST") or "127.0.0.1",
        port=settings.get("PORT") or 5432,
        user=settings.get("USER") or "postgres",
        password=settings.get("PASSWORD") or None,
        dbname="postgres",
        autocommit=True,
    )
    admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
    admin.execute(f'CREATE DATABASE "{name}"')
    url = f"postgres://{settings.get('USER') or 'postgres'}@{settings.get('HOST') or '127.0.0.1'}:{settings.get('PORT') or 5432}/{name}"
    with psycopg.connect(url.replace("postgres://", "postgresql://"), autocommit=True) as scratch:
        scratch.execute("CREATE TABLE tool_calls (id bigserial primary key, tool_call_id text)")
    try:
        yield url
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@pytest.mark.e2e
@pytest.mark.parametrize(
    "command",
    [
        ["-m", "uvicorn", "yuxi_project.asgi:application", "--host", "127.0.0.1", "--port", "{port}"],
        ["manage.py", "runserver", "--noreload", "127.0.0.1:{port}"],
        ["-m", "celery", "-A", "yuxi_project", "worker", "--pool=solo", "-Q", "schema-guard-unused", "-l", "info"],
    ],
    ids=["asgi", "runserver", "celery-worker"],
)
def test_processes_refuse_a_legacy_database_R_SCH_1(legacy_database, command):
    port = str(free_port())
    env = {**os.environ, "DATABASE_URL": legacy_database, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, *[part.replace("{port}", port) for part in command]],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "refusing to start" in output, output
    assert "tool_calls" in output and "manage.py migrate" in output, output
