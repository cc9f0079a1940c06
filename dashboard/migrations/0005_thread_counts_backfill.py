"""Fills what the triggers of conversations 0015 and audit 0021 keep from
now on: ``holds_replay`` of the threads that hold a replayed run, and the
conversation counts of every thread already there (the rollups count all
threads: unlike runs, a thread has no "not rolled up yet" state the
dashboard would count from its rows).

One pass over the threads (seconds per million); the thread rollup tables
are locked meanwhile, so a thread created concurrently is counted once,
by its trigger after this commits. Nothing to do on SQLite (no triggers,
no rollups)."""

from django.db import migrations

_FILL = [
    "UPDATE conversations_conversation SET holds_replay = TRUE WHERE NOT holds_replay"
    " AND id IN (SELECT thread_id FROM audit_agentrun WHERE replay_of <> '')",
    "LOCK TABLE dashboard_rollupthreadhour, dashboard_rollupthreadday IN SHARE ROW EXCLUSIVE MODE",
    "DELETE FROM dashboard_rollupthreadhour",
    "DELETE FROM dashboard_rollupthreadday",
    "INSERT INTO dashboard_rollupthreadhour (hour, model, agent_id, conversations)"
    " SELECT date_bin('1 hour', created_at, TIMESTAMPTZ '2000-01-01 00:00:00+00'), model, agent_id, COUNT(*)"
    " FROM conversations_conversation WHERE NOT holds_replay GROUP BY 1, 2, 3",
    "INSERT INTO dashboard_rollupthreadday (day, model, agent_id, conversations)"
    " SELECT (hour AT TIME ZONE 'UTC')::date, model, agent_id, SUM(conversations)"
    " FROM dashboard_rollupthreadhour GROUP BY 1, 2, 3",
]


def fill(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        for statement in _FILL:
            cursor.execute(statement)


class Migration(migrations.Migration):
    dependencies = [
        ("dashboard", "0004_thread_rollups"),
        ("conversations", "0015_thread_counted_triggers"),
        ("audit", "0021_run_replay_triggers"),
    ]

    operations = [migrations.RunPython(fill, migrations.RunPython.noop)]
