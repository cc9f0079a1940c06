"""The dashboard's conversation counts, kept by the database (R-DASH-1).

A conversation is counted in the hour it was created unless it holds a
replayed run (a replay's scratch thread, ``Conversation.objects.counted``,
issue 34). Counting them from the threads read every thread of the window:
O(threads), 91 ms of the overview's 110 ms at 10 M audit rows. Instead
every change of a thread that moves it into or out of the count adds ``+1``
or ``-1`` to its hour and UTC day in :class:`dashboard.models.RollupThreadHour`
and :class:`~dashboard.models.RollupThreadDay`, in the transaction that
makes it: the count commits or rolls back with the thread.

Triggers, not calls from the services, so every way a thread is written
counts (the API, the chat page, a replay, a raw ``INSERT``):

* on ``conversations_conversation`` (:data:`THREAD_TRIGGERS`): threads
  inserted or deleted (once per statement, grouped by hour), or a thread
  updated so that its hour, model, agent or ``holds_replay`` changes;
* on ``audit_agentrun`` (:data:`RUN_REPLAY_TRIGGERS`): a run whose ``replay_of``
  or thread changes sets ``holds_replay`` of the threads concerned to what
  their runs say (``EXISTS`` a run with ``replay_of``); the thread's own
  trigger then moves the count. A flag rather than a count of "other
  replayed runs": two runs of one thread marked by one statement both see
  each other, and the flag is set once whatever the order.

The row triggers fire only where their ``WHEN`` condition holds: an
ordinary update of a run or a thread (its lease, its title) calls nothing.

The rows written by a trigger hold only the conversation counts: no run's
end ever waits for them (a worker frozen in its terminal transaction holds
run rollup rows, never these). ``rebuild_rollups`` recomputes them from
the threads (:func:`dashboard.rollups.rebuild_day`).

Definitions only (the models declare them, so their migrations own them):
this module imports nothing of the project.
"""

from __future__ import annotations

import pgtrigger

THREAD_TABLE = "dashboard_rollupthreadhour"
THREAD_DAY_TABLE = "dashboard_rollupthreadday"

GRAIN = "1 hour"
ORIGIN = "TIMESTAMPTZ '2000-01-01 00:00:00+00'"


def hour_of(column: str) -> str:
    """The SQL of the UTC hour (its start) holding the timestamp ``column``."""
    return f"date_bin('{GRAIN}', {column}, {ORIGIN})"


def day_of(column: str) -> str:
    """The SQL of the UTC calendar day holding the timestamp ``column``."""
    return f"({column} AT TIME ZONE 'UTC')::date"


def _count(changes: str) -> str:
    """Add the conversation deltas ``changes`` (SQL of rows ``created_at,
    model, agent_id, delta``) to their hours and days: one upsert per
    table, grouped (a bulk insert of many threads adds once per hour, and
    no row is hit twice by one statement), in key order, the hour table
    first, as every writer of the two tables does."""
    return "".join(
        f"""
        INSERT INTO {table} ({bucket}, model, agent_id, conversations)
        SELECT {of("created_at")}, model, agent_id, SUM(delta) FROM ({changes}) changes
        GROUP BY 1, 2, 3 HAVING SUM(delta) <> 0 ORDER BY 1, 2, 3
        ON CONFLICT ({bucket}, model, agent_id)
        DO UPDATE SET conversations = {table}.conversations + EXCLUDED.conversations;"""
        for table, bucket, of in ((THREAD_TABLE, "hour", hour_of), (THREAD_DAY_TABLE, "day", day_of))
    )


# Inserts and deletes once per statement, over its transition table: a
# trigger per row upserting the same hour row again and again took 577 s
# for one INSERT of 400,000 threads (each upsert follows the chain of that
# row's versions written by the statement before it).
thread_counted_insert = pgtrigger.Trigger(
    name="thread_counted_insert",
    level=pgtrigger.Statement,
    when=pgtrigger.After,
    operation=pgtrigger.Insert,
    referencing=pgtrigger.Referencing(new="inserted"),
    func=f"""{_count("SELECT created_at, model, agent_id, 1 AS delta FROM inserted WHERE NOT holds_replay")}
        RETURN NULL;""",
)

# Row by row, only where a counted fact changes (WHEN): the ordinary
# updates of a thread (its title, its status) call nothing.
thread_counted_update = pgtrigger.Trigger(
    name="thread_counted_update",
    when=pgtrigger.After,
    operation=pgtrigger.Update,
    condition=pgtrigger.Condition(
        "((OLD.created_at, OLD.model, OLD.agent_id, OLD.holds_replay)"
        " IS DISTINCT FROM (NEW.created_at, NEW.model, NEW.agent_id, NEW.holds_replay))"
    ),
    func=f"""{
        _count(
            "SELECT OLD.created_at, OLD.model, OLD.agent_id, -1 AS delta WHERE NOT OLD.holds_replay"
            " UNION ALL SELECT NEW.created_at, NEW.model, NEW.agent_id, 1 WHERE NOT NEW.holds_replay"
        )
    }
        RETURN NULL;""",
)

thread_counted_delete = pgtrigger.Trigger(
    name="thread_counted_delete",
    level=pgtrigger.Statement,
    when=pgtrigger.After,
    operation=pgtrigger.Delete,
    referencing=pgtrigger.Referencing(old="deleted"),
    func=f"""{_count("SELECT created_at, model, agent_id, -1 AS delta FROM deleted WHERE NOT holds_replay")}
        RETURN NULL;""",
)

#: Declared on ``Conversation``.
THREAD_TRIGGERS = [thread_counted_insert, thread_counted_update, thread_counted_delete]


def _holds_replay(*threads: str) -> str:
    """Set ``holds_replay`` of the threads ``threads`` (SQL of their ids) to
    whether one of their runs is a replay, where it differs."""
    return f"""
        UPDATE conversations_conversation c SET holds_replay = x.holds
        FROM (SELECT t.id, EXISTS (SELECT 1 FROM audit_agentrun r WHERE r.thread_id = t.id AND r.replay_of <> '')
              AS holds FROM conversations_conversation t WHERE t.id IN ({", ".join(threads)})) x
        WHERE c.id = x.id AND c.holds_replay IS DISTINCT FROM x.holds;
        RETURN NULL;
    """


run_replay_insert = pgtrigger.Trigger(
    name="run_replay_insert",
    when=pgtrigger.After,
    operation=pgtrigger.Insert,
    condition=pgtrigger.Condition("NEW.replay_of <> ''"),
    func=_holds_replay("NEW.thread_id"),
)

run_replay_update = pgtrigger.Trigger(
    name="run_replay_update",
    when=pgtrigger.After,
    operation=pgtrigger.Update,
    condition=pgtrigger.Condition(
        "((OLD.replay_of <> '' OR NEW.replay_of <> '')"
        " AND (OLD.replay_of <> '', OLD.thread_id) IS DISTINCT FROM (NEW.replay_of <> '', NEW.thread_id))"
    ),
    func=_holds_replay("OLD.thread_id", "NEW.thread_id"),
)

run_replay_delete = pgtrigger.Trigger(
    name="run_replay_delete",
    when=pgtrigger.After,
    operation=pgtrigger.Delete,
    condition=pgtrigger.Condition("OLD.replay_of <> ''"),
    func=_holds_replay("OLD.thread_id"),
)

#: Declared on ``AgentRun``.
RUN_REPLAY_TRIGGERS = [run_replay_insert, run_replay_update, run_replay_delete]
