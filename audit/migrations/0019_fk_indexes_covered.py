"""The run's ``thread`` and ``user`` foreign keys lose their single-column
indexes: ``run_thread_created_idx`` (thread, created_at) and
``run_user_created_idx`` (user, -created_at) serve every lookup they
served, and each index is written on every new version of a run row (a run
writes three: start, end, rollup mark). A replay's ``run`` likewise
(``replay_run_created_idx``).

Only the indexes are dropped (quick: no table scan). Django's own
``AlterField`` would also drop and re-add the foreign keys, which
re-validates every row under an exclusive lock."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("audit", "0018_run_rollback_append_only"),
        ("conversations", "0014_fk_indexes_covered"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="agentrun",
                    name="thread",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="runs",
                        to="conversations.conversation",
                    ),
                ),
                migrations.AlterField(
                    model_name="agentrun",
                    name="user",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="agent_runs",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
                migrations.AlterField(
                    model_name="runreplay",
                    name="run",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="replays",
                        to="audit.agentrun",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    "DROP INDEX IF EXISTS audit_agentrun_thread_id_ee294858",
                    "CREATE INDEX IF NOT EXISTS audit_agentrun_thread_id_ee294858 ON audit_agentrun (thread_id)",
                ),
                migrations.RunSQL(
                    "DROP INDEX IF EXISTS audit_agentrun_user_id_21d46638",
                    "CREATE INDEX IF NOT EXISTS audit_agentrun_user_id_21d46638 ON audit_agentrun (user_id)",
                ),
                migrations.RunSQL(
                    "DROP INDEX IF EXISTS audit_runreplay_run_id_e567a2e3",
                    "CREATE INDEX IF NOT EXISTS audit_runreplay_run_id_e567a2e3 ON audit_runreplay (run_id)",
                ),
            ],
        ),
    ]
