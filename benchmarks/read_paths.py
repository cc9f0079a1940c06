"""Read paths at scale (``python manage.py bench_read_paths``; issue 11,
R-READ-1..3, R-ADM-1, R-ADM-2, R-DASH-1).

:func:`build_dataset` loads a realistic audit into an empty, migrated
database by bulk SQL (``generate_series``, one statement per table, foreign
key triggers and secondary indexes off during the load and rebuilt after):
``rows`` audit rows (model and tool rows) over the last 30 days, many
users and threads of about ten turns, one run of 20,000 rows, one thread of
1,000 turns. :func:`measure` then calls each read endpoint over HTTP with
Django's test client (in process: URL routing, middleware, authentication,
serialisation and templates; no socket) and times the best SQL for the
same answer with ``EXPLAIN ANALYZE`` (execution time, median of three).

This is a benchmark, not a test: it prints figures and asserts nothing.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from django.db import connection

from .figures import percentile

DAYS = 30
BIG_RUN_ROWS = 20_000
LONG_THREAD_TURNS = 1_000
TURNS_PER_THREAD = 10
# A turn with a tool: model call declaring it, the tool, the answer (3 audit
# rows); a plain turn: the answer (1). 7 turns in 10 use a tool.
AUDIT_ROWS_PER_RUN = 2.4
TOOLS = ("get_weather", "calculator", "lookup_docs", "send_email")
CITIES = (
    "Paris Berlin Tokyo Lagos Lima Oslo Quito Accra Hanoi Dakar Cairo Delhi Seoul Perth Sofia Riga "
    "Porto Turin Lyon Nice Kyoto Osaka Busan Pune Agra Fez Tunis Rabat Doha Muscat Baku Minsk Kyiv Lviv "
    "Graz Linz Bern Basel Ghent Bruges Leeds York Bath Cork Derry Turku Malmo Aarhus Split Zadar"
).split()
# One run in RARE_EVERY says this word: a full-text search with few matches.
CITY_SQL = "(ARRAY[" + ", ".join(f"'{c}'" for c in CITIES) + "])[g % 50 + 1]"
RARE_WORD = "zanzibar"
# In every tool row's content (``"conditions": "sunny", "celsius": n``):
# 7 turns in 10 have one, about one row in five.
COMMON_WORD = "celsius"
# The answer of a completed Paris run: one run in 50 less the failed ones.
PHRASE = '"sunny in Paris"'
RARE_EVERY = 5_000
MESSAGE_ID_BASE = 10  # message ids: run number * 4 + slot (0 user, 1 carrier, 2 tool, 3 answer)


@dataclass(frozen=True)
class Dataset:
    """What :func:`build_dataset` loaded: sizes and the ids the benchmark reads."""

    audit_rows: int
    runs: int
    threads: int
    users: int
    big_run_id: uuid.UUID
    big_thread_id: uuid.UUID
    long_thread_id: uuid.UUID
    long_thread_owner: str
    staff_username: str
    first_day: str
    last_day: str
    build_seconds: float = 0.0


def sizes(rows: int) -> dict[str, int]:
    """The dataset's shape for ``rows`` audit rows (small sizes shrink the
    big run and the long thread so that they stay a fraction of the whole)."""
    big = min(BIG_RUN_ROWS, max(40, rows // 50))
    long_turns = min(LONG_THREAD_TURNS, max(20, rows // 1000))
    generic_runs = max(10, int((rows - big - long_turns * AUDIT_ROWS_PER_RUN) / AUDIT_ROWS_PER_RUN))
    threads = max(1, generic_runs // TURNS_PER_THREAD)
    users = max(5, min(2_000, rows // 2_000))
    return {"big": big, "long_turns": long_turns, "runs": generic_runs, "threads": threads, "users": users}


def _uuid_sql(kind: str, expr: str) -> str:
    return f"md5('{kind}' || ({expr})::text)::uuid"


def _python_uuid(kind: str, number: int) -> uuid.UUID:
    import hashlib

    return uuid.UUID(hashlib.md5(f"{kind}{number}".encode()).hexdigest())


_STAFF = "bench-staff"


def build_dataset(*, rows: int = 1_000_000, log: Callable[[str], None] = print) -> Dataset:
    """Load the dataset into the (empty, migrated) database of the default
    connection. ``rows`` is the number of audit rows (model calls and tool
    executions); user messages come on top (one per turn). Returns what it
    loaded. Takes about a minute per million rows on two cores, most of it
    in the index builds."""
    started = time.perf_counter()
    s = sizes(rows)
    R, T, U, L, B = s["runs"], s["threads"], s["users"], s["long_turns"], s["big"]
    long_thread, big_thread = T + 1, T + 2
    with connection.cursor() as c:

        def run(label: str, sql: str, params=()) -> None:
            t0 = time.perf_counter()
            c.execute(sql, params)
            log(f"  {label}: {time.perf_counter() - t0:.1f} s")

        c.execute("SET session_replication_role = replica")  # no FK triggers during the load
        c.execute("SET maintenance_work_mem = '256MB'")
        c.execute("SET synchronous_commit = off")
        dropped = _drop_secondary_indexes(c, ["conversations_message", "audit_agentrun", "conversations_conversation"])
        c.execute("SELECT now() - interval '30 days', now()")
        t0, t1 = c.fetchone()
        run(
            "users",
            """INSERT INTO auth_user (password, is_superuser, username, first_name, last_name, email, is_staff,
                   is_active, date_joined)
               SELECT '!', false, 'bench-user-' || u, '', '', '', false, true, %s FROM generate_series(1, %s) u""",
            [t0, U + 1],
        )
        run(
            "staff user",
            """INSERT INTO auth_user (password, is_superuser, username, first_name, last_name, email, is_staff,
                   is_active, date_joined) VALUES ('!', true, %s, '', '', '', true, true, %s)""",
            [_STAFF, t0],
        )
        c.execute("SELECT min(id) FROM auth_user WHERE username LIKE 'bench-user-%%'")
        user_base = c.fetchone()[0] - 1
        # Threads 1..T: generic; T+1: the long thread (user U+1); T+2: the big run's.
        run(
            "threads",
            f"""INSERT INTO conversations_conversation (id, user_id, agent_id, model, title, status, created_at,
                   updated_at)
               SELECT {_uuid_sql("thread", "t")}, %s + CASE WHEN t = %s THEN %s ELSE (t - 1) %% %s + 1 END,
                   'assistant', 'replay:tool_then_answer', 'thread ' || t, 'active',
                   %s + (t::float / %s) * interval '2 days', %s
               FROM generate_series(1, %s) t""",
            [user_base, long_thread, U + 1, U, t0, T + 2, t1, T + 2],
        )
        # Runs 1..R generic (run g: thread (g-1) % T + 1, created in order of g
        # over the 30 days), R+1..R+L the long thread's turns, R+L+1 the big run.
        run(
            "runs",
            f"""INSERT INTO audit_agentrun (id, request_id, request_fingerprint, turn_id, agent_id, model, input,
                   status, lease_owner, fencing_token, error_type, error_message, usage, interrupts, trace_id,
                   created_at, started_at, finished_at, updated_at, output_message_id, thread_id, user_id,
                   dispatched_at)
               SELECT {_uuid_sql("run", "g")}, 'bench-' || g, '', {_uuid_sql("turn", "g")}, 'assistant',
                   'replay:tool_then_answer', jsonb_build_object('text', 'weather in ' || {CITY_SQL.replace("%", "%%")}),
                   st, NULL, 1, CASE WHEN st = 'failed' THEN 'model_error' ELSE '' END,
                   CASE WHEN st = 'failed' THEN 'the model answered 500' ELSE '' END,
                   jsonb_build_object('input_tokens', 300, 'output_tokens', 40, 'total_tokens', 340,
                                      'unknown_calls', 0),
                   NULL, '', created, created + interval '50 ms', created + interval '2 s' + (g %% 7) * interval '1 s',
                   created, CASE WHEN st = 'completed' THEN {MESSAGE_ID_BASE} + g * 4 + 3 END,
                   {_uuid_sql("thread", "th")},
                   {user_base} + CASE WHEN th = {long_thread} THEN {U + 1} ELSE (th - 1) %% {U} + 1 END, created
               FROM (SELECT g,
                       CASE WHEN g <= {R} THEN (g - 1) %% {T} + 1 WHEN g <= {R + L} THEN {long_thread}
                            ELSE {big_thread} END AS th,
                       CASE WHEN g <= {R} THEN %(t0)s + (g::float / {R}) * (%(t1)s - %(t0)s)
                            WHEN g <= {R + L} THEN %(t0)s + ((g - {R})::float / {L + 1}) * (%(t1)s - %(t0)s)
                            ELSE %(t1)s - interval '1 hour' END AS created,
                       CASE WHEN g > {R + L} THEN 'completed'
                            WHEN g %% 20 = 7 THEN 'failed' WHEN g %% 33 = 5 THEN 'cancelled'
                            ELSE 'completed' END AS st
                     FROM generate_series(1, {R + L + 1}) g) runs""",
            {"t0": t0, "t1": t1},
        )
        _load_messages(run, R=R, L=L, B=B, t0=t0)
        c.execute("SELECT max(id) FROM conversations_message")
        c.execute(
            "SELECT setval(pg_get_serial_sequence('conversations_message', 'id'), (SELECT max(id) FROM "
            "conversations_message))"
        )
        for _table, name, definition in dropped:
            run(f"index {name}", definition)
        c.execute("SET session_replication_role = DEFAULT")
        for table in ("auth_user", "conversations_conversation", "audit_agentrun", "conversations_message"):
            run(f"analyze {table}", f"VACUUM ANALYZE {table}")
        c.execute("SELECT count(*) FROM conversations_message WHERE operation_id IS NOT NULL")
        audit_rows = c.fetchone()[0]
    return Dataset(
        audit_rows=audit_rows,
        runs=R + L + 1,
        threads=T + 2,
        users=U + 1,
        big_run_id=_python_uuid("run", R + L + 1),
        big_thread_id=_python_uuid("thread", big_thread),
        long_thread_id=_python_uuid("thread", long_thread),
        long_thread_owner=f"bench-user-{U + 1}",
        staff_username=_STAFF,
        first_day=t0.date().isoformat(),
        last_day=t1.date().isoformat(),
        build_seconds=time.perf_counter() - started,
    )


#: The table of a dataset database that says which dataset it holds.
DATASET_TABLE = "bench_read_paths_dataset"


def stored_dataset(rows: int) -> Dataset | None:
    """The dataset of ``rows`` audit rows the current database holds (built
    by :func:`build_dataset` and recorded by :func:`store_dataset`), or
    ``None``."""
    with connection.cursor() as c:
        c.execute(f"CREATE TABLE IF NOT EXISTS {DATASET_TABLE} (rows integer PRIMARY KEY, dataset jsonb)")
        c.execute(f"SELECT dataset FROM {DATASET_TABLE} WHERE rows = %s", [rows])
        found = c.fetchone()
    if not found:
        return None
    data = found[0] if isinstance(found[0], dict) else json.loads(found[0])
    return Dataset(**data)


def store_dataset(dataset: Dataset, rows: int) -> None:
    """Record in the current database that it holds ``dataset``, built for
    ``rows`` audit rows."""
    import dataclasses

    with connection.cursor() as c:
        c.execute(f"CREATE TABLE IF NOT EXISTS {DATASET_TABLE} (rows integer PRIMARY KEY, dataset jsonb)")
        c.execute(
            f"INSERT INTO {DATASET_TABLE} VALUES (%s, %s)", [rows, json.dumps(dataclasses.asdict(dataset), default=str)]
        )


def rollup_tables() -> list[str]:
    """The dashboard's rollup tables."""
    from django.apps import apps

    return [m._meta.db_table for m in apps.get_app_config("dashboard").get_models()]


def settle(*, tables: list[str] | None = None, log: Callable[[str], None] = print) -> None:
    """``VACUUM (ANALYZE)`` ``tables`` (default: the runs and the rollup
    tables, after ``rebuild_rollups`` marked every run of a new dataset):
    the state autovacuum brings a table to once its writes settle (dead row
    versions gone, pages all-visible, statistics current). Without it the
    first measurement reads a run table twice its size whose pages all need
    a heap visit, and autovacuum may start in the middle of the measuring."""
    if tables is None:
        tables = ["audit_agentrun", *rollup_tables()]
    started = time.perf_counter()
    with connection.cursor() as c:
        for table in tables:
            c.execute(f"VACUUM (ANALYZE) {connection.ops.quote_name(table)}")
    log(f"vacuumed {', '.join(tables)}: {time.perf_counter() - started:.1f} s")


def _drop_secondary_indexes(c, tables: list[str]) -> list[tuple[str, str, str]]:
    """Drop the indexes of ``tables`` that back no constraint; return their
    definitions to rebuild them after the load (faster than maintaining
    them row by row)."""
    c.execute(
        """SELECT i.tablename, i.indexname, i.indexdef FROM pg_indexes i
           WHERE i.tablename = ANY(%s) AND NOT EXISTS (
               SELECT 1 FROM pg_constraint k WHERE k.conname = i.indexname)""",
        [tables],
    )
    found = c.fetchall()
    for _, name, _ in found:
        c.execute(f'DROP INDEX "{name}"')
    return found


def _load_messages(run, *, R: int, L: int, B: int, t0) -> None:
    """User messages and audit rows of the generic and long-thread runs
    (one statement), then the big run's rows (another)."""
    base = MESSAGE_ID_BASE
    cities = CITY_SQL.replace("%", "%%")
    tool = "(ARRAY['get_weather','calculator','lookup_docs','send_email'])[g %% 4 + 1]"
    rare = f"CASE WHEN g %% {RARE_EVERY} = 17 THEN ' {RARE_WORD}' ELSE '' END"
    # Slots: 0 user message, 1 model call declaring a tool, 2 tool row, 3 answer.
    # A plain turn (g % 10 >= 7) has slots 0 and 3; the answer of a failed
    # run is a failed model row, of a cancelled one an interrupted row.
    run(
        "messages (user, model, tool, answer)",
        f"""INSERT INTO conversations_message (id, role, message_type, content, tool_calls, metadata, operation_id,
               started_at, finished_at, duration_ms, sequence, execution_status, usage, tool_name, tool_input,
               created_at, updated_at, declared_by_id, run_id, thread_id, cost_usd, price_source, price_version)
           SELECT %s + g * 4 + slot,
               CASE slot WHEN 0 THEN 'user' WHEN 2 THEN 'tool' ELSE 'assistant' END,
               CASE WHEN slot = 0 THEN 'text' WHEN slot = 1 THEN 'model_audit' WHEN slot = 2 THEN 'tool_audit'
                    WHEN r.status = 'completed' THEN 'text' ELSE 'model_audit' END,
               CASE slot
                   WHEN 0 THEN 'What is the weather in ' || {cities} || ' today?' || {rare}
                   WHEN 1 THEN ''
                   WHEN 2 THEN '{{"city": "' || {cities} || '", "conditions": "sunny", "celsius": ' || (g %% 35)
                               || '}}'
                   ELSE 'It is sunny in ' || {cities} || ', ' || (g %% 35) || ' degrees (report ' || g || ').'
               END,
               CASE WHEN slot = 1 THEN jsonb_build_array(jsonb_build_object('id', 'call_' || g, 'name', {tool},
                   'args', jsonb_build_object('city', {cities}))) END,
               CASE slot
                   WHEN 0 THEN '{{}}'::jsonb
                   WHEN 2 THEN jsonb_build_object('namespace', '[]'::jsonb, 'raw_output',
                               jsonb_build_object('type', 'tool', 'tool_call_id', 'call_' || g))
                   ELSE jsonb_build_object('namespace', '[]'::jsonb, 'state_reconciled', true,
                               'model_name', 'replay', 'finish_reason', 'stop')
               END,
               CASE slot WHEN 0 THEN NULL WHEN 2 THEN 'call_' || g ELSE 'lc_run--' || g || '-' || slot END,
               CASE WHEN slot > 0 THEN r.created_at + slot * interval '400 ms' END,
               CASE WHEN slot > 0 THEN r.created_at + slot * interval '400 ms' + (g %% 900) * interval '1 ms' END,
               CASE WHEN slot > 0 THEN g %% 900 END,
               CASE WHEN slot = 0 THEN NULL WHEN g %% 10 >= 7 THEN 1 ELSE slot END,
               CASE WHEN slot = 0 THEN NULL
                    WHEN slot = 2 THEN CASE WHEN g %% 19 = 3 THEN 'failed' ELSE 'completed' END
                    WHEN slot = 3 AND r.status = 'failed' THEN 'failed'
                    WHEN slot = 3 AND r.status = 'cancelled' THEN 'interrupted'
                    ELSE 'completed' END,
               CASE WHEN slot IN (1, 3) THEN '{{"input_tokens": 150, "output_tokens": 20, "total_tokens": 170}}'::jsonb
                    END,
               CASE WHEN slot = 2 THEN {tool} ELSE '' END,
               CASE WHEN slot = 2 THEN jsonb_build_object('city', {cities}) END,
               r.created_at + slot * interval '400 ms', r.created_at + slot * interval '400 ms',
               CASE WHEN slot = 2 THEN %s + g * 4 + 1 END,
               r.id, r.thread_id,
               CASE WHEN slot IN (1, 3) THEN 0.00023 END,
               CASE WHEN slot IN (1, 3) THEN 'replay-default' ELSE '' END, ''
           FROM generate_series(1, %s) g
           JOIN audit_agentrun r ON r.id = {_uuid_sql("run", "g")}
           CROSS JOIN generate_series(0, 3) slot
           WHERE g %% 10 < 7 OR slot IN (0, 3)""",
        [base, base, R + L],
    )
    big = R + L + 1
    big_base = base + (big + 1) * 4
    run(
        f"messages (the {B}-row run)",
        f"""INSERT INTO conversations_message (id, role, message_type, content, tool_calls, metadata, operation_id,
               started_at, finished_at, duration_ms, sequence, execution_status, usage, tool_name, tool_input,
               created_at, updated_at, declared_by_id, run_id, thread_id, cost_usd, price_source, price_version)
           SELECT %s + i,
               CASE WHEN i = 0 THEN 'user' WHEN i %% 2 = 0 THEN 'tool' ELSE 'assistant' END,
               CASE WHEN i = 0 THEN 'text' WHEN i %% 2 = 0 THEN 'tool_audit' ELSE 'model_audit' END,
               CASE WHEN i = 0 THEN 'Check every city.' WHEN i %% 2 = 0 THEN 'result ' || i ELSE '' END,
               CASE WHEN i %% 2 = 1 THEN jsonb_build_array(jsonb_build_object('id', 'call_' || (i + 1),
                   'name', 'get_weather', 'args', jsonb_build_object('city', 'City ' || i))) END,
               CASE WHEN i = 0 THEN '{{}}'::jsonb ELSE jsonb_build_object('namespace', '[]'::jsonb,
                   'state_reconciled', true) END,
               CASE WHEN i = 0 THEN NULL WHEN i %% 2 = 0 THEN 'call_' || i ELSE 'lc_run--big-' || i END,
               CASE WHEN i > 0 THEN r.created_at + i * interval '100 ms' END,
               CASE WHEN i > 0 THEN r.created_at + i * interval '100 ms' + interval '80 ms' END,
               CASE WHEN i > 0 THEN 80 END,
               CASE WHEN i = 0 THEN NULL ELSE i END,
               CASE WHEN i = 0 THEN NULL ELSE 'completed' END,
               CASE WHEN i %% 2 = 1 THEN '{{"input_tokens": 150, "output_tokens": 20, "total_tokens": 170}}'::jsonb
                    END,
               CASE WHEN i > 0 AND i %% 2 = 0 THEN 'get_weather' ELSE '' END,
               CASE WHEN i > 0 AND i %% 2 = 0 THEN jsonb_build_object('city', 'City ' || i) END,
               r.created_at + i * interval '100 ms', r.created_at + i * interval '100 ms',
               CASE WHEN i > 0 AND i %% 2 = 0 THEN %s + i - 1 END,
               r.id, r.thread_id,
               CASE WHEN i %% 2 = 1 THEN 0.00023 END,
               CASE WHEN i %% 2 = 1 THEN 'replay-default' ELSE '' END, ''
           FROM generate_series(0, %s) i
           JOIN audit_agentrun r ON r.id = {_uuid_sql("run", big)}""",
        [big_base, big_base, B],
    )


# --------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------


@dataclass
class Endpoint:
    """One read over HTTP and the best SQL for the same answer.

    ``sql`` is ``(statement, params)`` hand-written, or ``None``: then the
    statements the endpoint ran are EXPLAINed and their times summed
    ("product SQL"). ``sql_source`` "product" marks an endpoint's own main
    statement given here because the endpoint runs it prepared, out of
    sight of the query log; ``serial`` EXPLAINs it as the product runs it,
    without parallel workers (:func:`core.db.serial_plans`)."""

    name: str
    path: str
    sql: tuple[str, list] | None = None
    admin: bool = False
    sql_source: str = ""
    serial: bool = False
    samples_ms: list[float] = field(default_factory=list)
    sql_ms: float | None = None


def explain_ms(sql: str, params: list, *, serial: bool = False) -> float:
    """Execution time of ``sql`` by ``EXPLAIN (ANALYZE)``, median of three,
    in ms; with ``serial``, planned without parallel workers."""
    from core.db import serial_plans

    times = []
    with serial_plans() if serial else contextlib.nullcontext(), connection.cursor() as c:
        for _ in range(3):
            c.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
            plan = c.fetchone()[0]
            plan = json.loads(plan) if isinstance(plan, str) else plan
            times.append(plan[0]["Execution Time"])
    return statistics.median(times)


def plan_of(sql: str, params: list, *, serial: bool = False) -> str:
    from core.db import serial_plans

    with serial_plans() if serial else contextlib.nullcontext(), connection.cursor() as c:
        c.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in c.fetchall())


def _is_data_statement(sql: str) -> bool:
    """A statement that reads the answer: not authentication, sessions,
    savepoints or the API token's ``last_used_at``."""
    head = sql.lstrip().upper()
    if not head.startswith(("SELECT", "WITH", "(SELECT")):
        return False
    return not any(t in sql for t in ('"django_session"', '"conversations_apitoken"', 'FROM "auth_user"'))


def captured_sql_ms(statements: list[tuple[str, Any]]) -> float:
    """The summed EXPLAIN ANALYZE time of the data statements among
    ``statements`` (``(sql, params)``: params for a prepared statement,
    which the query log keeps as sent; empty for Django's, whose SQL it
    keeps with the values in)."""
    return sum(explain_ms(sql, params) for sql, params in statements if _is_data_statement(sql))


def endpoints(ds: Dataset) -> list[Endpoint]:
    """The reads measured, with a hand-written statement where one answers
    the same question alone."""
    from audit.reads.selectors import _NO_SEQUENCE, _TIMELINE_KEY
    from conversations.selectors import memory_sql
    from conversations.sql import message_columns
    from core.cursors import encode_cursor

    with connection.cursor() as c:
        c.execute("SELECT created_at FROM audit_agentrun WHERE id = %s", [ds.big_run_id])
        (big_created,) = c.fetchone()
        c.execute(
            """SELECT id, sequence FROM conversations_message WHERE run_id = %s AND operation_id IS NOT NULL
               ORDER BY sequence OFFSET %s LIMIT 1""",
            [ds.big_run_id, max(1, ds.audit_rows and _big_rows(c, ds) // 2)],
        )
        mid_id, mid_seq = c.fetchone()
        big = f"{_big_rows(c, ds):,}-row run"
        turns = f"{_count(c, 'audit_agentrun', 'thread_id', ds.long_thread_id):,} turns"
        # A turn of the long thread five days after the start: 25 days old.
        c.execute(
            """SELECT r.id, r.created_at, m.id FROM audit_agentrun r JOIN conversations_message m
                   ON m.run_id = r.id AND m.role = 'user'
               WHERE r.thread_id = %s ORDER BY r.created_at OFFSET %s LIMIT 1""",
            [ds.long_thread_id, _count(c, "audit_agentrun", "thread_id", ds.long_thread_id) // 6],
        )
        old_run, old_created, old_user_message = c.fetchone()
        c.execute("SELECT id FROM audit_agentrun WHERE status = 'failed' ORDER BY created_at DESC LIMIT 1")
        (failed_run,) = c.fetchone()
    assert _TIMELINE_KEY[2][0] == "sequence_key" and mid_seq != _NO_SEQUENCE
    mid_cursor = encode_cursor([big_created.isoformat(), str(ds.big_run_id), mid_seq, mid_id])
    old_cursor = encode_cursor([old_created.isoformat(), str(old_run), 0, _NO_SEQUENCE, old_user_message])
    cols = message_columns()
    run_page = f"""SELECT {cols} FROM conversations_message WHERE run_id = %s AND operation_id IS NOT NULL {{}}
                   ORDER BY sequence DESC NULLS FIRST, id DESC LIMIT 501"""
    window = f"from={ds.first_day}&to={ds.last_day}"
    week_ago = (dt.date.fromisoformat(ds.last_day) - dt.timedelta(days=7)).isoformat()
    runs_api = "/api/audit/runs?limit=50"
    return [
        Endpoint(
            f"run timeline, {big}, first page",
            f"/api/audit/runs/{ds.big_run_id}/timeline",
            (run_page.format(""), [ds.big_run_id]),
        ),
        Endpoint(
            f"run timeline, {big}, middle page",
            f"/api/audit/runs/{ds.big_run_id}/timeline?before={mid_cursor}",
            (run_page.format("AND (sequence, id) < (%s, %s)"), [ds.big_run_id, mid_seq, mid_id]),
        ),
        Endpoint(
            f"export, {big}, JSON lines",
            f"/api/audit/runs/{ds.big_run_id}/export?format=jsonl",
            # The database writing the same rows as JSON itself (issue 38).
            (
                """SELECT row_to_json(m)::text FROM conversations_message m
                   WHERE run_id = %s AND operation_id IS NOT NULL ORDER BY sequence, id""",
                [ds.big_run_id],
            ),
        ),
        Endpoint(f"thread timeline, {turns}", f"/api/audit/threads/{ds.long_thread_id}/timeline"),
        Endpoint("history, recent turns", f"/api/threads/{ds.long_thread_id}/history"),
        Endpoint("history, turns 25 days old", f"/api/threads/{ds.long_thread_id}/history?before={old_cursor}"),
        Endpoint(
            f"memory, {turns}",
            f"/api/threads/{ds.long_thread_id}/memory",
            memory_sql(ds.long_thread_id, include_tools=False),
            sql_source="product",
            serial=True,
        ),
        Endpoint(
            f"memory with tools, {turns}",
            f"/api/threads/{ds.long_thread_id}/memory?include_tools=true",
            memory_sql(ds.long_thread_id, include_tools=True),
            sql_source="product",
            serial=True,
        ),
        Endpoint("search: run list, no filter", runs_api),
        # Words of every frequency (R-ADM-2: each decides its own plan): a
        # rare word, a city (one run in 50; about 1 row in 43), a word of
        # every tool row (about 1 row in 5) and a phrase (1 row in 170).
        Endpoint(f"search: q={RARE_WORD} (rare word)", f"{runs_api}&q={RARE_WORD}"),
        Endpoint("search: q=Paris (1 row in 50)", f"{runs_api}&q=Paris"),
        Endpoint(f"search: q={COMMON_WORD} (1 row in 5)", f"{runs_api}&q={COMMON_WORD}"),
        Endpoint(f"search: q={PHRASE} (phrase)", f"{runs_api}&q={quote(PHRASE)}"),
        Endpoint("search: q=run id prefix", f"{runs_api}&q={str(failed_run)[:8]}"),
        Endpoint("search: status=failed, tool=send_email", f"{runs_api}&status=failed&tool=send_email"),
        Endpoint("search: tool=lookup_docs&tool_status=failed", f"{runs_api}&tool=lookup_docs&tool_status=failed"),
        Endpoint(
            "search: error_type + user + a week",
            f"{runs_api}&error_type=model_error&user=bench-user-3&from={week_ago}T00:00:00",
        ),
        Endpoint("dashboard overview", f"/api/dashboard/overview?{window}"),
        Endpoint("dashboard tools", f"/api/dashboard/tools?{window}"),
        Endpoint("dashboard timeseries", f"/api/dashboard/timeseries?{window}"),
        Endpoint("dashboard costs", f"/api/dashboard/costs?{window}"),
        Endpoint("admin run list", "/admin/audit/agentrun/", admin=True),
        Endpoint("admin run list, status=failed", "/admin/audit/agentrun/?status=failed", admin=True),
        Endpoint("admin run search, q=Paris (1 row in 50)", "/admin/audit/agentrun/?q=Paris", admin=True),
        Endpoint(
            f"admin run search, q={COMMON_WORD} (1 row in 5)", f"/admin/audit/agentrun/?q={COMMON_WORD}", admin=True
        ),
        Endpoint(f"admin run search, q={RARE_WORD} (rare word)", f"/admin/audit/agentrun/?q={RARE_WORD}", admin=True),
        Endpoint(f"admin run page, {big}", f"/admin/audit/agentrun/{ds.big_run_id}/change/", admin=True),
        Endpoint("admin run page live refresh", f"/admin/audit/agentrun/{ds.big_run_id}/timeline/", admin=True),
        Endpoint("admin thread list", "/admin/conversations/conversation/", admin=True),
        Endpoint(
            f"admin thread page, {turns}",
            f"/admin/conversations/conversation/{ds.long_thread_id}/change/",
            admin=True,
        ),
        Endpoint(
            "admin thread timeline", f"/admin/conversations/conversation/{ds.long_thread_id}/timeline/", admin=True
        ),
        Endpoint("admin message list", "/admin/conversations/message/", admin=True),
    ]


def _big_rows(c, ds: Dataset) -> int:
    return _count(c, "conversations_message", "run_id", ds.big_run_id)


def _count(c, table: str, column: str, value) -> int:
    c.execute(f"SELECT count(*) FROM {table} WHERE {column} = %s", [value])
    return c.fetchone()[0]


def measure(
    ds: Dataset,
    *,
    rounds: int = 5,
    repeat: int = 10,
    only: tuple[str, ...] = (),
    log: Callable[[str], None] = print,
) -> list[Endpoint]:
    """Call every endpoint ``repeat`` times per round, rounds interleaved
    (round 1 calls every endpoint, then round 2 …), so that load on the
    machine spreads over all of them; then the SQL times. A call slower
    than a second is repeated twice per round only."""
    from django.contrib.auth import get_user_model
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    from conversations.models import ApiToken
    from yuxi_project.runtime import tune_gc

    # As the web server does once its application is loaded.
    tune_gc()
    users = get_user_model().objects
    staff = users.get(username=ds.staff_username)
    owner = users.get(username=ds.long_thread_owner)
    staff_token = ApiToken.objects.issue(user=staff, name="bench")[1]
    owner_token = ApiToken.objects.issue(user=owner, name="bench")[1]
    api, admin = Client(), Client()
    admin.force_login(staff)
    points = [p for p in endpoints(ds) if not only or any(word in p.name for word in only)]

    def call(point: Endpoint):
        if point.admin:
            return admin.get(point.path)
        token = owner_token if point.path.startswith("/api/threads/") else staff_token
        return api.get(point.path, headers={"Authorization": f"Bearer {token}"})

    statements: dict[str, list[tuple[str, Any]]] = {}
    for point in points:  # warm-up, and the statements each endpoint runs
        with CaptureQueriesContext(connection) as queries:
            response = call(point)
        if response.status_code != 200:
            raise RuntimeError(f"{point.name}: HTTP {response.status_code} {response.content[:300]!r}")
        if response.streaming:
            b"".join(response.streaming_content)
        statements[point.name] = [(q["sql"], q.get("params") or []) for q in queries.captured_queries]
    for n in range(rounds):
        for point in points:
            times = 2 if point.samples_ms and max(point.samples_ms) > 1000 else repeat
            for _ in range(times):
                t0 = time.perf_counter()
                response = call(point)
                if response.streaming:
                    b"".join(response.streaming_content)
                point.samples_ms.append((time.perf_counter() - t0) * 1000)
        log(f"  round {n + 1}/{rounds} done")
    for point in points:
        if point.sql is not None:
            point.sql_ms = explain_ms(*point.sql, serial=point.serial)
            point.sql_source = point.sql_source or "hand"
        else:
            point.sql_ms, point.sql_source = captured_sql_ms(statements[point.name]), "product"
    return points


def report(points: list[Endpoint]) -> list[str]:
    """Lines of the results table."""
    lines = [
        f"{'endpoint':<46} {'p50 ms':>8} {'p95 ms':>8} {'SQL ms':>8} {'source':>7} {'p50/SQL':>8}",
    ]
    for p in points:
        p50, p95 = statistics.median(p.samples_ms), percentile(p.samples_ms, 0.95)
        ratio = f"{p50 / p.sql_ms:.1f}x" if p.sql_ms else "—"
        lines.append(f"{p.name:<46} {p50:>8.1f} {p95:>8.1f} {p.sql_ms or 0:>8.2f} {p.sql_source:>7} {ratio:>8}")
    return lines
