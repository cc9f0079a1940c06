"""One audit row per operation of a run *attempt* (R-RUN-15, R-EFF-1).

A run whose worker died is continued by another worker as the same run with
``attempt`` + 1: a tool call it executes again, or replays from the effect
ledger, is a new row of the new attempt under the same tool call id, beside
the earlier attempt's row. The unique key becomes (run, role, operation id,
attempt); its index still serves every lookup by (run, role, operation id).
Both steps run in the migration's one transaction.
"""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('audit', '0012_run_attempt'),
        ('conversations', '0010_cjk_phrase_search'),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name='message',
            name='message_run_role_operation_uniq',
        ),
        migrations.AddConstraint(
            model_name='message',
            constraint=models.UniqueConstraint(condition=models.Q(('operation_id__isnull', False)), fields=('run', 'role', 'operation_id', 'attempt'), name='message_run_role_operation_uniq'),
        ),
    ]
