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
            trigger=pgtrigger.compiler.Trigger(name='thread_counted_insert', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN (NOT NEW.holds_replay)', func="\n        INSERT INTO dashboard_rollupthreadhour (hour, model, agent_id, conversations)\n        VALUES (date_bin('1 hour', NEW.created_at, TIMESTAMPTZ '2000-01-01 00:00:00+00'), NEW.model, NEW.agent_id, 1)\n        ON CONFLICT (hour, model, agent_id)\n        DO UPDATE SET conversations = dashboard_rollupthreadhour.conversations + EXCLUDED.conversations;\n        INSERT INTO dashboard_rollupthreadday (day, model, agent_id, conversations)\n        VALUES ((NEW.created_at AT TIME ZONE 'UTC')::date, NEW.model, NEW.agent_id, 1)\n        ON CONFLICT (day, model, agent_id)\n        DO UPDATE SET conversations = dashboard_rollupthreadday.conversations + EXCLUDED.conversations; RETURN NULL;", hash='bafc4208a3e251790e14deacc2a5366741074abd', operation='INSERT', pgid='pgtrigger_thread_counted_insert_6f28f', table='conversations_conversation', when='AFTER')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='conversation',
            trigger=pgtrigger.compiler.Trigger(name='thread_counted_update', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN ((OLD.created_at, OLD.model, OLD.agent_id, OLD.holds_replay) IS DISTINCT FROM (NEW.created_at, NEW.model, NEW.agent_id, NEW.holds_replay))', func="\n        IF NOT OLD.holds_replay THEN \n        INSERT INTO dashboard_rollupthreadhour (hour, model, agent_id, conversations)\n        VALUES (date_bin('1 hour', OLD.created_at, TIMESTAMPTZ '2000-01-01 00:00:00+00'), OLD.model, OLD.agent_id, -1)\n        ON CONFLICT (hour, model, agent_id)\n        DO UPDATE SET conversations = dashboard_rollupthreadhour.conversations + EXCLUDED.conversations;\n        INSERT INTO dashboard_rollupthreadday (day, model, agent_id, conversations)\n        VALUES ((OLD.created_at AT TIME ZONE 'UTC')::date, OLD.model, OLD.agent_id, -1)\n        ON CONFLICT (day, model, agent_id)\n        DO UPDATE SET conversations = dashboard_rollupthreadday.conversations + EXCLUDED.conversations;\n        END IF;\n        IF NOT NEW.holds_replay THEN \n        INSERT INTO dashboard_rollupthreadhour (hour, model, agent_id, conversations)\n        VALUES (date_bin('1 hour', NEW.created_at, TIMESTAMPTZ '2000-01-01 00:00:00+00'), NEW.model, NEW.agent_id, 1)\n        ON CONFLICT (hour, model, agent_id)\n        DO UPDATE SET conversations = dashboard_rollupthreadhour.conversations + EXCLUDED.conversations;\n        INSERT INTO dashboard_rollupthreadday (day, model, agent_id, conversations)\n        VALUES ((NEW.created_at AT TIME ZONE 'UTC')::date, NEW.model, NEW.agent_id, 1)\n        ON CONFLICT (day, model, agent_id)\n        DO UPDATE SET conversations = dashboard_rollupthreadday.conversations + EXCLUDED.conversations;\n        END IF;\n        RETURN NULL;\n    ", hash='251766203c1a68e8e6a7572aedb0ae54d09fa96f', operation='UPDATE', pgid='pgtrigger_thread_counted_update_d2146', table='conversations_conversation', when='AFTER')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='conversation',
            trigger=pgtrigger.compiler.Trigger(name='thread_counted_delete', sql=pgtrigger.compiler.UpsertTriggerSql(condition='WHEN (NOT OLD.holds_replay)', func="\n        INSERT INTO dashboard_rollupthreadhour (hour, model, agent_id, conversations)\n        VALUES (date_bin('1 hour', OLD.created_at, TIMESTAMPTZ '2000-01-01 00:00:00+00'), OLD.model, OLD.agent_id, -1)\n        ON CONFLICT (hour, model, agent_id)\n        DO UPDATE SET conversations = dashboard_rollupthreadhour.conversations + EXCLUDED.conversations;\n        INSERT INTO dashboard_rollupthreadday (day, model, agent_id, conversations)\n        VALUES ((OLD.created_at AT TIME ZONE 'UTC')::date, OLD.model, OLD.agent_id, -1)\n        ON CONFLICT (day, model, agent_id)\n        DO UPDATE SET conversations = dashboard_rollupthreadday.conversations + EXCLUDED.conversations; RETURN NULL;", hash='49bbdc7372b2810e40933a052081caea87aa6fd1', operation='DELETE', pgid='pgtrigger_thread_counted_delete_8803d', table='conversations_conversation', when='AFTER')),
        ),
    ]
