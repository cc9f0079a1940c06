"""A user-hour rollup's ``user`` foreign key loses its single-column index:
the unique key ``rollup_user_hour_key`` (user, hour) serves it, and the
index is written at every run's end (each run adds to its user's hour).

Only the index is dropped (quick: no table scan). Django's own
``AlterField`` would also drop and re-add the foreign key, which
re-validates every row under an exclusive lock."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("dashboard", "0002_day_rollups"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="rollupuserhour",
                    name="user",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="+",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    "DROP INDEX IF EXISTS dashboard_rollupuserhour_user_id_ca61594a",
                    "CREATE INDEX IF NOT EXISTS dashboard_rollupuserhour_user_id_ca61594a ON dashboard_rollupuserhour (user_id)",
                ),
            ],
        ),
    ]
