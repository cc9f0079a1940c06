"""Helpers of the governance tests: sealed runs from the real write path
(``tests.read.builders``), verify_audit as a command, and changes made
behind the application's back."""

from __future__ import annotations

import io

from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection


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
