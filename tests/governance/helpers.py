"""Helpers of the governance tests: sealed runs from the real write path
(``tests.read.builders``), verify_audit as a command, and changes made
behind the application's back."""

from __future__ import annotations

import io
import uuid

from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

MARKER = f"zqxmarker{uuid.uuid4().hex[:12]}"


def verify(*args: str) -> tuple[int, str, str]:
    """Run ``verify_audit`` with ``args``: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        call_command("verify_audit", *args, stdout=out, stderr=err)
        status = 0
    except CommandError as exc:
        status = exc.returncode
        err.write(str(exc))
    return status, out.getvalue(), err.getvalue()


def behind_the_back(sql: str, params=None) -> None:
    """Execute ``sql`` the way an intruder with superuser rights would: with
    ordinary triggers switched off for this session
    (``session_replication_role = replica``), so that only the seal can
    catch the change."""
    with connection.cursor() as cursor:
        cursor.execute("SET session_replication_role = replica")
        try:
            cursor.execute(sql, params)
        finally:
            cursor.execute("SET session_replication_role = DEFAULT")


def scan(marker: str) -> set[str]:
    """``table.column`` of every text, JSON, tsvector and bytea column of
    the public schema that holds ``marker`` (case-insensitive: the search
    vector lower-cases)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT table_name, column_name, data_type FROM information_schema.columns
               JOIN information_schema.tables USING (table_schema, table_name)
               WHERE table_schema = 'public' AND table_type = 'BASE TABLE'
                 AND data_type IN ('text', 'character varying', 'character', 'json', 'jsonb', 'tsvector', 'bytea')"""
        )
        columns = cursor.fetchall()
        found = set()
        for table, column, data_type in columns:
            if data_type == "bytea":
                condition = f"position(convert_to(%s, 'UTF8') in \"{column}\") > 0"
                value = marker
            else:
                condition = f'"{column}"::text ILIKE %s'
                value = f"%{marker}%"
            cursor.execute(f'SELECT EXISTS (SELECT 1 FROM "{table}" WHERE {condition})', [value])
            if cursor.fetchone()[0]:
                found.add(f"{table}.{column}")
    return found


def files_with(root, marker: str) -> list[str]:
    return [str(path) for path in root.rglob("*") if path.is_file() and marker.encode() in path.read_bytes()] + [
        str(path) for path in root.rglob("*") if marker in path.name
    ]
