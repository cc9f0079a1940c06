"""A delivery's ``run`` and an attempt's ``delivery`` lose their
single-column indexes: the unique keys ``webhook_delivery_run_end_uniq``
(run, run_finished_at) and ``webhook_attempt_number_uniq`` (delivery,
number) serve them.

Only the index is dropped (quick: no table scan). Django's own
``AlterField`` would also drop and re-add the foreign key, which
re-validates every row under an exclusive lock."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("webhooks", "0003_delivery_plural"),
        ("audit", "0019_fk_indexes_covered"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="webhookdelivery",
                    name="run",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="webhook_deliveries",
                        to="audit.agentrun",
                    ),
                ),
                migrations.AlterField(
                    model_name="webhookattempt",
                    name="delivery",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="attempt_rows",
                        to="webhooks.webhookdelivery",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    "DROP INDEX IF EXISTS webhooks_webhookdelivery_run_id_ae7d9b35",
                    "CREATE INDEX IF NOT EXISTS webhooks_webhookdelivery_run_id_ae7d9b35 ON webhooks_webhookdelivery (run_id)",
                ),
                migrations.RunSQL(
                    "DROP INDEX IF EXISTS webhooks_webhookattempt_delivery_id_c57db657",
                    "CREATE INDEX IF NOT EXISTS webhooks_webhookattempt_delivery_id_c57db657 ON webhooks_webhookattempt (delivery_id)",
                ),
            ],
        ),
    ]
