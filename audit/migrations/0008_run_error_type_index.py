from django.db import migrations, models


class Migration(migrations.Migration):
    """The run list filtered by error type, newest first (R-ADM-2)."""

    dependencies = [
        ("audit", "0007_run_finished_idx"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="agentrun",
            index=models.Index(
                condition=models.Q(("error_type", ""), _negated=True),
                fields=["error_type", "-created_at"],
                name="run_error_created_idx",
            ),
        ),
    ]
