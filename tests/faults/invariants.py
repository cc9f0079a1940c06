"""What must hold after any fault, checked in SQL (SPEC §6, R-RUN-9..12).

:func:`check` returns one sentence per violation (an empty list when all
hold). Each invariant is one query, so a new fault test gets all of them:

1. every accepted turn has its run and its user message;
2. no run is non-terminal without a live lease (a pending run counts as
   stuck once the batch has settled);
3. no audit row is ``running`` under a terminal run;
4. a run's usage equals the sum of its model rows, and calls without usage
   stay unknown (``unknown_calls``), never zero;
5. FIFO per thread: a run of a later turn starts only after every run of
   the earlier turns ended;
6. no two rows share ``(run, role, operation_id, attempt)``;
7. no ``send_email`` effect key was executed twice (a replay is no
   execution, R-EFF-1).

The eighth — a new turn on every affected thread completes — needs HTTP:
:func:`tests.faults.harness.new_turn_on_each_thread`.
"""

from __future__ import annotations

import psycopg

LIVE_LEASE_SLACK_SECONDS = 1.0

QUERIES: dict[str, str] = {
    "run not terminal without a live lease": """
        SELECT id::text, status, lease_expires_at::text FROM audit_agentrun
        WHERE thread_id = ANY(%(threads)s::uuid[])
          AND (status = 'pending'
               OR (status IN ('running', 'cancel_requested')
                   AND (lease_expires_at IS NULL
                        OR lease_expires_at < now() - make_interval(secs => %(slack)s))))
    """,
    "running audit row under a terminal run": """
        SELECT m.id::text, m.role, m.operation_id, r.status FROM conversations_message m
        JOIN audit_agentrun r ON r.id = m.run_id
        WHERE r.thread_id = ANY(%(threads)s::uuid[])
          AND m.execution_status = 'running'
          AND r.status IN ('completed', 'failed', 'cancelled', 'interrupted')
    """,
    "run usage differs from the sum of its model rows": """
        WITH model_rows AS (
            SELECT run_id,
                   sum(coalesce((usage->>'input_tokens')::bigint, 0)) AS input_tokens,
                   sum(coalesce((usage->>'output_tokens')::bigint, 0)) AS output_tokens,
                   count(*) FILTER (WHERE usage IS NULL OR usage = 'null'::jsonb) AS unknown_calls
            FROM conversations_message
            WHERE role = 'assistant' AND operation_id IS NOT NULL
            GROUP BY run_id
        )
        SELECT r.id::text, r.usage::text, row_to_json(m)::text FROM audit_agentrun r
        LEFT JOIN model_rows m ON m.run_id = r.id
        WHERE r.thread_id = ANY(%(threads)s::uuid[])
          AND r.status IN ('completed', 'failed', 'cancelled', 'interrupted')
          AND r.usage IS NOT NULL
          AND (coalesce((r.usage->>'input_tokens')::bigint, 0) <> coalesce(m.input_tokens, 0)
               OR coalesce((r.usage->>'output_tokens')::bigint, 0) <> coalesce(m.output_tokens, 0)
               OR coalesce((r.usage->>'unknown_calls')::bigint, 0) <> coalesce(m.unknown_calls, 0))
    """,
    "a later turn started before an earlier turn ended (FIFO)": """
        WITH turns AS (
            SELECT thread_id, turn_id, min(created_at) AS turn_start FROM audit_agentrun
            WHERE thread_id = ANY(%(threads)s::uuid[]) GROUP BY thread_id, turn_id
        ),
        runs AS (
            SELECT r.id, r.thread_id, r.turn_id, r.started_at, r.finished_at, t.turn_start
            FROM audit_agentrun r JOIN turns t USING (thread_id, turn_id)
        )
        SELECT later.id::text, earlier.id::text FROM runs later
        JOIN runs earlier ON earlier.thread_id = later.thread_id
          AND (earlier.turn_start, earlier.turn_id::text) < (later.turn_start, later.turn_id::text)
        WHERE later.started_at IS NOT NULL
          AND (earlier.finished_at IS NULL OR earlier.finished_at > later.started_at)
    """,
    "duplicate (run, role, operation_id, attempt)": """
        SELECT run_id::text, role, operation_id, attempt, count(*) FROM conversations_message
        WHERE operation_id IS NOT NULL AND thread_id = ANY(%(threads)s::uuid[])
        GROUP BY run_id, role, operation_id, attempt HAVING count(*) > 1
    """,
    "send_email executed twice under one effect key (R-EFF-1)": """
        SELECT effect_key, count(*) FROM conversations_message
        WHERE thread_id = ANY(%(threads)s::uuid[]) AND role = 'tool' AND tool_name = 'send_email'
          AND replayed_from_id IS NULL AND started_at IS NOT NULL
        GROUP BY effect_key HAVING count(*) > 1
    """,
}


def check(conn: psycopg.Connection, *, threads: list[str], accepted_request_ids: list[str]) -> list[str]:
    """Run every invariant over the runs of ``threads``; ``accepted_request_ids``
    are the turns the API accepted (200/202). Returns the violations."""
    violations: list[str] = []
    params = {"threads": threads, "slack": LIVE_LEASE_SLACK_SECONDS}
    for name, sql in QUERIES.items():
        for row in conn.execute(sql, params).fetchall():
            violations.append(f"{name}: {row}")
    missing = conn.execute(
        """
        SELECT a.request_id FROM unnest(%s::text[]) AS a(request_id)
        LEFT JOIN audit_agentrun r ON r.request_id = a.request_id
        LEFT JOIN conversations_message m ON m.run_id = r.id AND m.role = 'user'
        WHERE r.id IS NULL OR m.id IS NULL
        """,
        [accepted_request_ids],
    ).fetchall()
    violations += [f"accepted turn without its run or user message: {row[0]}" for row in missing]
    return violations
