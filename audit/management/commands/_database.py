"""A clear refusal for commands run where no database is set up.

Without ``DATABASE_URL`` the settings choose a SQLite file
``var/yuxi.sqlite3`` (the quick start's embedded mode is an embedded
PostgreSQL now, reached by its own ``DATABASE_URL``); opening it creates it,
empty, and the command then fails deep inside with ``no such table``. Commands that read or write data
derive from :class:`DatabaseCommand`, which calls :func:`require_database`
before anything else: one line saying what to set, and no file created.
"""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from core.config import get_config

HINT = (
    "set DATABASE_URL to the database bin/quickstart uses (by default "
    "DATABASE_URL=postgres://postgres@127.0.0.1:5432/yuxi; for the quick start's embedded PostgreSQL, "
    'DATABASE_URL="$(.venv/bin/python bin/pg_embedded.py start var/pgdata yuxi)" starts it and prints its URL)'
)


def require_database(*, tables: bool = True) -> None:
    """Raise :class:`CommandError` (one line, no traceback) when the
    configured database cannot hold this project's data: an embedded SQLite
    file that does not exist (it is not created), an unreachable server, or
    (``tables=True``) a database without the project's tables
    (``manage.py migrate`` not run)."""
    settings = connection.settings_dict
    if connection.vendor == "sqlite":
        name = str(settings["NAME"])
        if name != ":memory:" and not Path(name).exists():
            if get_config().DATABASE_URL:
                raise CommandError(f"there is no SQLite database at {name}: {HINT}")
            raise CommandError(f"DATABASE_URL is not set: {HINT}")
    try:
        present = set(connection.introspection.table_names())
    except Exception as exc:  # unreachable server, bad credentials, ...
        raise CommandError(f"cannot open the database ({type(exc).__name__}: {exc}); {HINT}") from None
    if tables and ("auth_user" not in present or "audit_agentrun" not in present):
        raise CommandError(
            f"database {settings['NAME']!s} has no tables of this project: run manage.py migrate first, or {HINT}"
        )


class DatabaseCommand(BaseCommand):
    """A command that reads or writes the project's data: it refuses with
    :func:`require_database` before anything opens the database (Django's
    system checks do, which would create an empty SQLite file).

    ``project_tables = False`` for a command that migrates a database of its
    own (``bench_read_paths``): it needs the server, not the tables."""

    project_tables = True
    # The exit status of that refusal (a checker's "could not check" is 2).
    refusal_returncode = 1

    def execute(self, *args, **options):
        try:
            require_database(tables=self.project_tables)
        except CommandError as exc:
            exc.returncode = self.refusal_returncode
            raise
        return super().execute(*args, **options)
