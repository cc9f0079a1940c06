"""Refuse to serve against a database whose schema is not this code's (R-SCH-1).

Django migrations own the schema. The web process (ASGI and WSGI entry
points, so also ``manage.py runserver``) and the Celery worker call
:func:`ensure_schema_matches` before they take any work. It refuses when

* migrations of this code are not applied (``manage.py migrate`` was not run),
* the database records applied migrations this code does not know (it was
  migrated by a newer or another version), or
* the retired legacy ``tool_calls`` table still exists (tool executions are
  ``tool_audit`` rows of the message table now; seed 004).

Nothing is changed in the database: the guard only reads.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.migrations.executor import MigrationExecutor

LEGACY_TABLES = ("tool_calls",)


class SchemaMismatch(ImproperlyConfigured):
    """The database schema does not match the code; the message says what
    to do. ``problems`` lists each finding."""

    def __init__(self, problems: list[str], *, alias: str):
        self.problems = problems
        database = connections[alias].settings_dict.get("NAME")
        super().__init__(
            f"refusing to start: the schema of database {database!r} does not match this code (R-SCH-1):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


def schema_problems(alias: str = DEFAULT_DB_ALIAS) -> list[str]:
    """What is wrong with database ``alias`` for this code: a list of
    sentences, each saying what to do; empty when the schema matches.

    Raises the database driver's error when the database is unreachable.
    """
    connection = connections[alias]
    problems: list[str] = []
    tables = set(connection.introspection.table_names())
    legacy = [t for t in LEGACY_TABLES if t in tables]
    if legacy:
        problems.append(
            f"the retired table(s) {', '.join(legacy)} still exist: tool executions are now tool_audit rows of "
            "conversations_message; export what you need from them, then drop them "
            f"(DROP TABLE {', '.join(legacy)};)"
        )
    executor = MigrationExecutor(connection)
    if not executor.recorder.has_table():
        problems.append("the database has no migration history: run `python manage.py migrate`")
        return problems
    graph = executor.loader.graph
    known = set(graph.nodes)
    for migration in executor.loader.disk_migrations.values():
        known.update(getattr(migration, "replaces", None) or [])
    unknown = sorted(key for key in executor.recorder.applied_migrations() if key not in known)
    if unknown:
        names = ", ".join(f"{app}.{name}" for app, name in unknown)
        problems.append(
            f"applied migrations unknown to this code: {names}; the database was migrated by another version: "
            "deploy the matching code or point DATABASE_URL at this version's database"
        )
    # Every node of the graph, not only the plan towards the leaves: with a
    # later migration applied, the plan misses a gap earlier in its chain.
    applied = executor.loader.applied_migrations or {}
    missing = [key for key in sorted(graph.nodes) if key not in applied]
    if missing:
        names = ", ".join(f"{app}.{name}" for app, name in missing[:10]) + (" …" if len(missing) > 10 else "")
        problems.append(f"{len(missing)} migration(s) not applied ({names}): run `python manage.py migrate`")
    return problems


def ensure_schema_matches(alias: str = DEFAULT_DB_ALIAS) -> None:
    """Raise :class:`SchemaMismatch` unless the schema matches (R-SCH-1).
    Closes the connection it used, so a process that forks afterwards does
    not share it."""
    try:
        problems = schema_problems(alias)
    finally:
        connections[alias].close()
    if problems:
        raise SchemaMismatch(problems, alias=alias)
