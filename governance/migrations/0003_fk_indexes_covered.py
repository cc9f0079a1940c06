"""A reseal's ``run`` loses its single-column index: ``gov_reseal_run_idx``
(run, -created_at) serves it.

Only the index is dropped (quick: no table scan). Django's own
``AlterField`` would also drop and re-add the foreign key, which
re-validates every row under an exclusive lock."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("governance", "0002_audit_digest"),
        ("audit", "0019_fk_indexes_covered"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="runreseal",
                    name="run",
                    field=models.ForeignKey(
                        db_index=False,
                        db_constraint=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="+",
                        to="audit.agentrun",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    "DROP INDEX IF EXISTS governance_runreseal_run_id_fb2313bf",
                    "CREATE INDEX IF NOT EXISTS governance_runreseal_run_id_fb2313bf ON governance_runreseal (run_id)",
                ),
            ],
        ),
    ]
