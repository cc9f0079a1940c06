"""The triggers that set a thread's ``holds_replay`` when one of its runs
becomes, or stops being, a replay (conversations.triggers)."""

import pgtrigger.compiler
import pgtrigger.migrations
from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('audit', '0020_run_replay_thread_index'),
        ('conversations', '0015_thread_counted_triggers'),
    ]

    operations = [
        pgtrigger.migrations.AddTrigger(
            model_name='agentrun',
            trigger=pgtrigger.compiler.Trigger(name='run_replay_insert', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (NEW.replay_of <> '')", func="\n        UPDATE conversations_conversation c SET holds_replay = x.holds\n        FROM (SELECT t.id, EXISTS (SELECT 1 FROM audit_agentrun r WHERE r.thread_id = t.id AND r.replay_of <> '')\n              AS holds FROM conversations_conversation t WHERE t.id IN (NEW.thread_id)) x\n        WHERE c.id = x.id AND c.holds_replay IS DISTINCT FROM x.holds;\n        RETURN NULL;\n    ", hash='e1c0a17b7bfe4c109375f6ba56992989ddf4f28a', operation='INSERT', pgid='pgtrigger_run_replay_insert_20c01', table='audit_agentrun', when='AFTER')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='agentrun',
            trigger=pgtrigger.compiler.Trigger(name='run_replay_update', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN ((OLD.replay_of <> '' OR NEW.replay_of <> '') AND (OLD.replay_of <> '', OLD.thread_id) IS DISTINCT FROM (NEW.replay_of <> '', NEW.thread_id))", func="\n        UPDATE conversations_conversation c SET holds_replay = x.holds\n        FROM (SELECT t.id, EXISTS (SELECT 1 FROM audit_agentrun r WHERE r.thread_id = t.id AND r.replay_of <> '')\n              AS holds FROM conversations_conversation t WHERE t.id IN (OLD.thread_id, NEW.thread_id)) x\n        WHERE c.id = x.id AND c.holds_replay IS DISTINCT FROM x.holds;\n        RETURN NULL;\n    ", hash='146e051883c60f6846e2134b69e3acab909109de', operation='UPDATE', pgid='pgtrigger_run_replay_update_86dd4', table='audit_agentrun', when='AFTER')),
        ),
        pgtrigger.migrations.AddTrigger(
            model_name='agentrun',
            trigger=pgtrigger.compiler.Trigger(name='run_replay_delete', sql=pgtrigger.compiler.UpsertTriggerSql(condition="WHEN (OLD.replay_of <> '')", func="\n        UPDATE conversations_conversation c SET holds_replay = x.holds\n        FROM (SELECT t.id, EXISTS (SELECT 1 FROM audit_agentrun r WHERE r.thread_id = t.id AND r.replay_of <> '')\n              AS holds FROM conversations_conversation t WHERE t.id IN (OLD.thread_id)) x\n        WHERE c.id = x.id AND c.holds_replay IS DISTINCT FROM x.holds;\n        RETURN NULL;\n    ", hash='aa1c90acd5c91558e08241fc045ae65c8069ac53', operation='DELETE', pgid='pgtrigger_run_replay_delete_c1d00', table='audit_agentrun', when='AFTER')),
        ),
    ]
