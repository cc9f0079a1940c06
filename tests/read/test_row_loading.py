"""The paged readers load a page of audit rows faster than the ORM (JSON
columns parsed per column, timestamps by psycopg's own loader where it
gives what Django's gives) and must load exactly what the ORM loads
(issue 11, R-RUN-11)."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection

from conversations.models import Message
from conversations.sql import message_columns, message_rows
from tests.conftest import acquire, make_run

pytestmark = pytest.mark.django_db

T0 = dt.datetime(2026, 3, 1, 12, 30, 15, 123456, tzinfo=dt.UTC)

_VALUES = [
    None,
    {},
    {"a": [1, 2.5, None, True], "nested": {"k": "v"}},
    {"text": "NUL \x00 and a lone surrogate \ud83d here"},
    ["x", {"y": "\u4e2d\u6587"}],
    {"big": 2**70, "float": 0.1 + 0.2},
]


def _rows_as_the_orm_loads_them(run) -> list[Message]:
    return list(Message.objects.filter(run=run).order_by("id"))


def _rows_as_the_readers_load_them(run) -> list[Message]:
    table = Message._meta.db_table
    return message_rows(f"SELECT {message_columns()} FROM {table} WHERE run_id = %s ORDER BY id", [run.pk])


def _same(a: Message, b: Message) -> None:
    for f in Message._meta.concrete_fields:
        left, right = getattr(a, f.attname), getattr(b, f.attname)
        assert left == right, f.name
        assert type(left) is type(right), f.name
        if isinstance(left, dt.datetime):
            assert left.tzinfo is right.tzinfo, f.name


@pytest.fixture
def rows(thread):
    run = make_run(thread)
    acquire(run)
    for i, value in enumerate(_VALUES):
        Message.objects.create(
            thread=thread,
            run=run,
            role=Message.Role.TOOL,
            message_type=Message.Type.TOOL_AUDIT,
            operation_id=f"call-{i}",
            tool_name="lookup",
            tool_input=value,
            metadata={"raw_output": value} if value is not None else {},
            usage=value if isinstance(value, dict) else None,
            started_at=T0 + dt.timedelta(seconds=i),
            finished_at=None if i % 2 else T0 + dt.timedelta(seconds=i, microseconds=7),
            execution_status="completed",
        )
    return run


def test_a_page_loads_exactly_what_the_orm_loads(rows):
    orm = _rows_as_the_orm_loads_them(rows)
    readers = _rows_as_the_readers_load_them(rows)
    assert len(readers) == len(orm) == len(_VALUES) + 1  # and the run's user message
    for a, b in zip(orm, readers, strict=True):
        _same(a, b)


def test_one_row_loads_exactly_what_the_orm_loads(rows):
    """One row takes the per-value path (a fenced write's RETURNING)."""
    first = _rows_as_the_orm_loads_them(rows)[4]  # the NUL and surrogate one
    table = Message._meta.db_table
    [one] = message_rows(f"SELECT {message_columns()} FROM {table} WHERE id = %s", [first.pk])
    _same(first, one)


def test_a_session_in_another_time_zone_keeps_djangos_loader(rows):
    """psycopg's loader would give the session's zone; the readers must
    still load what the ORM loads (Django's loader, which assumes the
    session is in the connection's zone, as Django keeps it)."""
    with connection.cursor() as cursor:
        cursor.execute("SET TIME ZONE 'Asia/Shanghai'")
    try:
        orm = _rows_as_the_orm_loads_them(rows)
        readers = _rows_as_the_readers_load_them(rows)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SET TIME ZONE 'UTC'")
    for a, b in zip(orm, readers, strict=True):
        _same(a, b)
