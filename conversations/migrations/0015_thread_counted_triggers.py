"""A thread's ``holds_replay`` flag and the triggers that count the
conversations per hour in the dashboard's thread rollups (conversations.triggers);
dashboard 0005 fills both for the threads already there."""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('conversations', '0014_fk_indexes_covered'),
        ('dashboard', '0004_thread_rollups'),
    ]

    operations = [
        migrations.AddField(
            model_name='conversation',
            name='holds_replay',
            field=models.BooleanField(db_default=False, default=False, editable=False),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='conversation',
            trigger=pgtrigger.compiler.Trigger(name='thread_counted_insert', sql=pgtrigger.compiler.UpsertTriggerSql(func="\n        INSERT INTO dashboard_rollupthreadhour (hour, model, agent_id, conversations)\n        SELECT date_bin('1 hour', created_at, TIMESTAMPTZ '2000-01-01 00:00:00+00'), model, agent_id, SUM(delta) FROM (SELECT created_at, model, agent_id, 1 AS delta FROM inserted WHERE NOT holds_replay) changes\n        GROUP BY 1, 2, 3 HAVING SUM(delta) <> 0 ORDER BY 1, 2, 3\n        ON CONFLICT (hour, model, agent_id)\n        DO UPDATE SET conversations = dashboard_rollupthreadhour.conversations + EXCLUDED.conversations;\n        INSERT INTO dashboard_rollupthreadday (day, model, agent_id, conversations)\n        SELECT (created_at AT TIME ZONE 'UTC')::date, model, agent_id, SUM(delta) FROM (SELECT created_at, model, agent_id, 1 AS delta FROM inserted WHERE NOT holds_replay) changes\n        GROUP BY 1, 2, 3 HAVING SUM(delta) <> 0 ORDER BY 1, 2, 3\n        ON CONFLICT (day, model, agent_id)\n        DO UPDATE SET conversations = dashboard_rollupthreadday.conversations + EXCLUDED.conversations;\n        RETURN NULL;", hash='f15967db4715dd0e66d842705ece0ac689eb4a30', level='STATEMENT', operation='INSERT', pgid='pgtrigger_thread_counted_insert_6f28f', referencing='REFERENCING NEW TABLE AS inserted ', table='conversations_conversation', when='AFTER')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='conversation',
            trigger=pgtrigger.compiler.Trigger(name='thread_counted_update', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN ((OLD.created_at, OLD.model, OLD.agent_id, OLD.holds_replay) IS DISTINCT FROM (NEW.created_at, NEW.model, NEW.agent_id, NEW.holds_replay))', func="\n        INSERT INTO dashboard_rollupthreadhour (hour, model, agent_id, conversations)\n        SELECT date_bin('1 hour', created_at, TIMESTAMPTZ '2000-01-01 00:00:00+00'), model, agent_id, SUM(delta) FROM (SELECT OLD.created_at, OLD.model, OLD.agent_id, -1 AS delta WHERE NOT OLD.holds_replay UNION ALL SELECT NEW.created_at, NEW.model, NEW.agent_id, 1 WHERE NOT NEW.holds_replay) changes\n        GROUP BY 1, 2, 3 HAVING SUM(delta) <> 0 ORDER BY 1, 2, 3\n        ON CONFLICT (hour, model, agent_id)\n        DO UPDATE SET conversations = dashboard_rollupthreadhour.conversations + EXCLUDED.conversations;\n        INSERT INTO dashboard_rollupthreadday (day, model, agent_id, conversations)\n        SELECT (created_at AT TIME ZONE 'UTC')::date, model, agent_id, SUM(delta) FROM (SELECT OLD.created_at, OLD.model, OLD.agent_id, -1 AS delta WHERE NOT OLD.holds_replay UNION ALL SELECT NEW.created_at, NEW.model, NEW.agent_id, 1 WHERE NOT NEW.holds_replay) changes\n        GROUP BY 1, 2, 3 HAVING SUM(delta) <> 0 ORDER BY 1, 2, 3\n        ON CONFLICT (day, model, agent_id)\n        DO UPDATE SET conversations = dashboard_rollupthreadday.conversations + EXCLUDED.conversations;\n        RETURN NULL;", hash='9c866bb237924e80e8f1bc93880a2a0e8a4f7ef2', operation='UPDATE', pgid='pgtrigger_thread_counted_update_d2146', table='conversations_conversation', when='AFTER')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='conversation',
            trigger=pgtrigger.compiler.Trigger(name='thread_counted_delete', sql=pgtrigger.compiler.UpsertTriggerSql(func="\n        INSERT INTO dashboard_rollupthreadhour (hour, model, agent_id, conversations)\n        SELECT date_bin('1 hour', created_at, TIMESTAMPTZ '2000-01-01 00:00:00+00'), model, agent_id, SUM(delta) FROM (SELECT created_at, model, agent_id, -1 AS delta FROM deleted WHERE NOT holds_replay) changes\n        GROUP BY 1, 2, 3 HAVING SUM(delta) <> 0 ORDER BY 1, 2, 3\n        ON CONFLICT (hour, model, agent_id)\n        DO UPDATE SET conversations = dashboard_rollupthreadhour.conversations + EXCLUDED.conversations;\n        INSERT INTO dashboard_rollupthreadday (day, model, agent_id, conversations)\n        SELECT (created_at AT TIME ZONE 'UTC')::date, model, agent_id, SUM(delta) FROM (SELECT created_at, model, agent_id, -1 AS delta FROM deleted WHERE NOT holds_replay) changes\n        GROUP BY 1, 2, 3 HAVING SUM(delta) <> 0 ORDER BY 1, 2, 3\n        ON CONFLICT (day, model, agent_id)\n        DO UPDATE SET conversations = dashboard_rollupthreadday.conversations + EXCLUDED.conversations;\n        RETURN NULL;", hash='58319222b3d939ddd327650efbb8c6c48a1487f4', level='STATEMENT', operation='DELETE', pgid='pgtrigger_thread_counted_delete_8803d', referencing='REFERENCING OLD TABLE AS deleted ', table='conversations_conversation', when='AFTER')),
        ),
    ]
