"""The links of the users' active hours (dashboard.triggers): each active
hour's previous active hour of its user, their counts per (hour, previous
hour) and, for each user's first active hour of a day, per (day, previous
hour), and the triggers that keep them from now on; then the links of the
hour rows already there.

The fill runs with the per-user hour rows locked against writers (SHARE
ROW EXCLUSIVE): a run ending meanwhile waits, then its trigger links its
hour to what the fill wrote. Three passes over the active user hours.
Nothing to do on SQLite (no triggers, no rollups)."""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models

_FILL = [
    "LOCK TABLE dashboard_rollupuserhour IN SHARE ROW EXCLUSIVE MODE",
    "UPDATE dashboard_rollupuserhour a SET previous_active_hour = l.since FROM (SELECT id,"
    " LAG(hour) OVER (PARTITION BY user_id ORDER BY hour) AS since FROM dashboard_rollupuserhour"
    " WHERE user_messages > 0) l WHERE a.id = l.id AND a.previous_active_hour IS DISTINCT FROM l.since",
    "DELETE FROM dashboard_rollupactivehour",
    "INSERT INTO dashboard_rollupactivehour (hour, since, users) SELECT hour, previous_active_hour, COUNT(*)"
    " FROM dashboard_rollupuserhour WHERE user_messages > 0 GROUP BY 1, 2",
    "DELETE FROM dashboard_rollupactiveday",
    "INSERT INTO dashboard_rollupactiveday (day, since, users) SELECT (hour AT TIME ZONE 'UTC')::date,"
    " previous_active_hour, COUNT(*) FROM dashboard_rollupuserhour WHERE user_messages > 0"
    " AND (previous_active_hour IS NULL"
    " OR (previous_active_hour AT TIME ZONE 'UTC')::date < (hour AT TIME ZONE 'UTC')::date) GROUP BY 1, 2",
]


def fill(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        for statement in _FILL:
            cursor.execute(statement)


class Migration(migrations.Migration):

    dependencies = [
        ('dashboard', '0005_thread_counts_backfill'),
    ]

    operations = [
        migrations.CreateModel(
            name='RollupActiveDay',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('day', models.DateField(help_text='UTC day.')),
                ('since', models.DateTimeField(help_text='The hour the users were last active before (empty: never).', null=True)),
                ('users', models.BigIntegerField(db_default=0, default=0)),
            ],
        ),
        migrations.CreateModel(
            name='RollupActiveHour',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('hour', models.DateTimeField()),
                ('since', models.DateTimeField(help_text='The hour the users were last active before (empty: never).', null=True)),
                ('users', models.BigIntegerField(db_default=0, default=0)),
            ],
        ),
        migrations.AddField(
            model_name='rollupuserhour',
            name='previous_active_hour',
            field=models.DateTimeField(editable=False, help_text='An hour in which the user was active (user messages): the hour they were last active before it; empty for their first. Kept by the database (dashboard.triggers).', null=True),
        ),
        migrations.AddConstraint(
            model_name='rollupactiveday',
            constraint=models.UniqueConstraint(fields=('day', 'since'), include=('users',), name='rollup_active_day_key', nulls_distinct=False),
        ),
        migrations.AddConstraint(
            model_name='rollupactivehour',
            constraint=models.UniqueConstraint(fields=('hour', 'since'), include=('users',), name='rollup_active_hour_key', nulls_distinct=False),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='rollupuserhour',
            trigger=pgtrigger.compiler.Trigger(name='user_hours_insert', sql=pgtrigger.compiler.UpsertTriggerSql(func="\n        IF NOT (EXISTS (SELECT user_id, hour FROM inserted WHERE user_messages > 0)) THEN\n            RETURN NULL;\n        END IF;\n        \n        INSERT INTO dashboard_rollupactivehour (hour, since, users)\n        SELECT hour, since, SUM(delta) FROM (SELECT hour, previous_active_hour AS since, 1 AS delta FROM inserted WHERE user_messages > 0) counted\n        GROUP BY 1, 2 HAVING SUM(delta) <> 0 ORDER BY 1, 2\n        ON CONFLICT (hour, since) DO UPDATE SET users = dashboard_rollupactivehour.users + EXCLUDED.users;\n        INSERT INTO dashboard_rollupactiveday (day, since, users)\n        SELECT (hour AT TIME ZONE 'UTC')::date, since, SUM(delta) FROM (SELECT hour, previous_active_hour AS since, 1 AS delta FROM inserted WHERE user_messages > 0) counted WHERE (since IS NULL OR (since AT TIME ZONE 'UTC')::date < (hour AT TIME ZONE 'UTC')::date)\n        GROUP BY 1, 2 HAVING SUM(delta) <> 0 ORDER BY 1, 2\n        ON CONFLICT (day, since) DO UPDATE SET users = dashboard_rollupactiveday.users + EXCLUDED.users;\n        IF NOT EXISTS (SELECT 1 FROM (SELECT user_id, hour FROM inserted WHERE user_messages > 0) flips) THEN\n            RETURN NULL;\n        END IF;\n        PERFORM pg_advisory_xact_lock(5110301, user_id)\n        FROM (SELECT DISTINCT user_id FROM (SELECT user_id, hour FROM inserted WHERE user_messages > 0) flips ORDER BY user_id) users;\n        WITH touched AS (SELECT user_id, MIN(hour) AS first, MAX(hour) AS last FROM (SELECT user_id, hour FROM inserted WHERE user_messages > 0) flips GROUP BY user_id),\n        bounds AS (\n            SELECT t.user_id,\n                (SELECT MAX(a.hour) FROM dashboard_rollupuserhour a\n                 WHERE a.user_id = t.user_id AND a.hour < t.first AND a.user_messages > 0) AS lo,\n                (SELECT MIN(a.hour) FROM dashboard_rollupuserhour a\n                 WHERE a.user_id = t.user_id AND a.hour > t.last AND a.user_messages > 0) AS hi\n            FROM touched t\n        ),\n        links AS (\n            SELECT a.id, a.hour, LAG(a.hour) OVER (PARTITION BY a.user_id ORDER BY a.hour) AS since, b.lo\n            FROM bounds b JOIN dashboard_rollupuserhour a ON a.user_id = b.user_id AND a.user_messages > 0\n            AND a.hour >= COALESCE(b.lo, '-infinity'::timestamptz) AND a.hour <= COALESCE(b.hi, 'infinity'::timestamptz)\n        )\n        UPDATE dashboard_rollupuserhour a SET previous_active_hour = l.since FROM links l\n        WHERE a.id = l.id AND (l.lo IS NULL OR l.hour > l.lo) AND a.previous_active_hour IS DISTINCT FROM l.since;\n        RETURN NULL;", hash='7de1e8d1298682d64cad72395db04b96370be77a', level='STATEMENT', operation='INSERT', pgid='pgtrigger_user_hours_insert_7b4cf', referencing='REFERENCING NEW TABLE AS inserted ', table='dashboard_rollupuserhour', when='AFTER')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='rollupuserhour',
            trigger=pgtrigger.compiler.Trigger(name='user_hours_update', sql=pgtrigger.compiler.UpsertTriggerSql(func="\n        IF NOT (EXISTS (SELECT 1 FROM after_rows n FULL JOIN before_rows o ON o.id = n.id WHERE (n.user_messages > 0, n.hour, n.user_id, n.previous_active_hour) IS DISTINCT FROM (o.user_messages > 0, o.hour, o.user_id, o.previous_active_hour))) THEN\n            RETURN NULL;\n        END IF;\n        \n        INSERT INTO dashboard_rollupactivehour (hour, since, users)\n        SELECT hour, since, SUM(delta) FROM (SELECT hour, previous_active_hour AS since, 1 AS delta FROM after_rows WHERE user_messages > 0 UNION ALL SELECT hour, previous_active_hour AS since, -1 AS delta FROM before_rows WHERE user_messages > 0) counted\n        GROUP BY 1, 2 HAVING SUM(delta) <> 0 ORDER BY 1, 2\n        ON CONFLICT (hour, since) DO UPDATE SET users = dashboard_rollupactivehour.users + EXCLUDED.users;\n        INSERT INTO dashboard_rollupactiveday (day, since, users)\n        SELECT (hour AT TIME ZONE 'UTC')::date, since, SUM(delta) FROM (SELECT hour, previous_active_hour AS since, 1 AS delta FROM after_rows WHERE user_messages > 0 UNION ALL SELECT hour, previous_active_hour AS since, -1 AS delta FROM before_rows WHERE user_messages > 0) counted WHERE (since IS NULL OR (since AT TIME ZONE 'UTC')::date < (hour AT TIME ZONE 'UTC')::date)\n        GROUP BY 1, 2 HAVING SUM(delta) <> 0 ORDER BY 1, 2\n        ON CONFLICT (day, since) DO UPDATE SET users = dashboard_rollupactiveday.users + EXCLUDED.users;\n        IF NOT EXISTS (SELECT 1 FROM ((SELECT user_id, hour FROM after_rows WHERE user_messages > 0 EXCEPT SELECT user_id, hour FROM before_rows WHERE user_messages > 0) UNION (SELECT user_id, hour FROM before_rows WHERE user_messages > 0 EXCEPT SELECT user_id, hour FROM after_rows WHERE user_messages > 0)) flips) THEN\n            RETURN NULL;\n        END IF;\n        PERFORM pg_advisory_xact_lock(5110301, user_id)\n        FROM (SELECT DISTINCT user_id FROM ((SELECT user_id, hour FROM after_rows WHERE user_messages > 0 EXCEPT SELECT user_id, hour FROM before_rows WHERE user_messages > 0) UNION (SELECT user_id, hour FROM before_rows WHERE user_messages > 0 EXCEPT SELECT user_id, hour FROM after_rows WHERE user_messages > 0)) flips ORDER BY user_id) users;\n        WITH touched AS (SELECT user_id, MIN(hour) AS first, MAX(hour) AS last FROM ((SELECT user_id, hour FROM after_rows WHERE user_messages > 0 EXCEPT SELECT user_id, hour FROM before_rows WHERE user_messages > 0) UNION (SELECT user_id, hour FROM before_rows WHERE user_messages > 0 EXCEPT SELECT user_id, hour FROM after_rows WHERE user_messages > 0)) flips GROUP BY user_id),\n        bounds AS (\n            SELECT t.user_id,\n                (SELECT MAX(a.hour) FROM dashboard_rollupuserhour a\n                 WHERE a.user_id = t.user_id AND a.hour < t.first AND a.user_messages > 0) AS lo,\n                (SELECT MIN(a.hour) FROM dashboard_rollupuserhour a\n                 WHERE a.user_id = t.user_id AND a.hour > t.last AND a.user_messages > 0) AS hi\n            FROM touched t\n        ),\n        links AS (\n            SELECT a.id, a.hour, LAG(a.hour) OVER (PARTITION BY a.user_id ORDER BY a.hour) AS since, b.lo\n            FROM bounds b JOIN dashboard_rollupuserhour a ON a.user_id = b.user_id AND a.user_messages > 0\n            AND a.hour >= COALESCE(b.lo, '-infinity'::timestamptz) AND a.hour <= COALESCE(b.hi, 'infinity'::timestamptz)\n        )\n        UPDATE dashboard_rollupuserhour a SET previous_active_hour = l.since FROM links l\n        WHERE a.id = l.id AND (l.lo IS NULL OR l.hour > l.lo) AND a.previous_active_hour IS DISTINCT FROM l.since;\n        RETURN NULL;", hash='7503a21f34afdc819cfed3ec1f6f872a82872cf9', level='STATEMENT', operation='UPDATE', pgid='pgtrigger_user_hours_update_22e88', referencing='REFERENCING OLD TABLE AS before_rows  NEW TABLE AS after_rows ', table='dashboard_rollupuserhour', when='AFTER')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='rollupuserhour',
            trigger=pgtrigger.compiler.Trigger(name='user_hours_delete', sql=pgtrigger.compiler.UpsertTriggerSql(func="\n        IF NOT (EXISTS (SELECT user_id, hour FROM deleted WHERE user_messages > 0)) THEN\n            RETURN NULL;\n        END IF;\n        \n        INSERT INTO dashboard_rollupactivehour (hour, since, users)\n        SELECT hour, since, SUM(delta) FROM (SELECT hour, previous_active_hour AS since, -1 AS delta FROM deleted WHERE user_messages > 0) counted\n        GROUP BY 1, 2 HAVING SUM(delta) <> 0 ORDER BY 1, 2\n        ON CONFLICT (hour, since) DO UPDATE SET users = dashboard_rollupactivehour.users + EXCLUDED.users;\n        INSERT INTO dashboard_rollupactiveday (day, since, users)\n        SELECT (hour AT TIME ZONE 'UTC')::date, since, SUM(delta) FROM (SELECT hour, previous_active_hour AS since, -1 AS delta FROM deleted WHERE user_messages > 0) counted WHERE (since IS NULL OR (since AT TIME ZONE 'UTC')::date < (hour AT TIME ZONE 'UTC')::date)\n        GROUP BY 1, 2 HAVING SUM(delta) <> 0 ORDER BY 1, 2\n        ON CONFLICT (day, since) DO UPDATE SET users = dashboard_rollupactiveday.users + EXCLUDED.users;\n        IF NOT EXISTS (SELECT 1 FROM (SELECT user_id, hour FROM deleted WHERE user_messages > 0) flips) THEN\n            RETURN NULL;\n        END IF;\n        PERFORM pg_advisory_xact_lock(5110301, user_id)\n        FROM (SELECT DISTINCT user_id FROM (SELECT user_id, hour FROM deleted WHERE user_messages > 0) flips ORDER BY user_id) users;\n        WITH touched AS (SELECT user_id, MIN(hour) AS first, MAX(hour) AS last FROM (SELECT user_id, hour FROM deleted WHERE user_messages > 0) flips GROUP BY user_id),\n        bounds AS (\n            SELECT t.user_id,\n                (SELECT MAX(a.hour) FROM dashboard_rollupuserhour a\n                 WHERE a.user_id = t.user_id AND a.hour < t.first AND a.user_messages > 0) AS lo,\n                (SELECT MIN(a.hour) FROM dashboard_rollupuserhour a\n                 WHERE a.user_id = t.user_id AND a.hour > t.last AND a.user_messages > 0) AS hi\n            FROM touched t\n        ),\n        links AS (\n            SELECT a.id, a.hour, LAG(a.hour) OVER (PARTITION BY a.user_id ORDER BY a.hour) AS since, b.lo\n            FROM bounds b JOIN dashboard_rollupuserhour a ON a.user_id = b.user_id AND a.user_messages > 0\n            AND a.hour >= COALESCE(b.lo, '-infinity'::timestamptz) AND a.hour <= COALESCE(b.hi, 'infinity'::timestamptz)\n        )\n        UPDATE dashboard_rollupuserhour a SET previous_active_hour = l.since FROM links l\n        WHERE a.id = l.id AND (l.lo IS NULL OR l.hour > l.lo) AND a.previous_active_hour IS DISTINCT FROM l.since;\n        RETURN NULL;", hash='97eb32c7f180f9bd47b9444caaa23849199c80c3', level='STATEMENT', operation='DELETE', pgid='pgtrigger_user_hours_delete_7095c', referencing='REFERENCING OLD TABLE AS deleted ', table='dashboard_rollupuserhour', when='AFTER')),
        ),
        migrations.RunPython(fill, migrations.RunPython.noop),
    ]
