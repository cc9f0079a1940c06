# Idempotency keys per user, shared by submit and resume (R-IDEM-1).
#
# Existing rows stay valid: request_id was unique across all runs, so it is
# unique per user too. The new unique index is built before the old one is
# dropped (all in one transaction), so no moment allows a duplicate. Existing
# runs keep an empty request_fingerprint; audit.ledger.idempotency derives theirs
# from the stored thread, resumed run and input.

from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('audit', '0004_run_created_index'),
        ('conversations', '0002_dashboard_indexes'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddField(
            model_name='agentrun',
            name='request_fingerprint',
            field=models.CharField(blank=True, default='', max_length=64),
        ),
        migrations.AddConstraint(
            model_name='agentrun',
            constraint=models.UniqueConstraint(fields=('request_id', 'user'), name='run_request_id_user_uniq'),
        ),
        migrations.AlterField(
            model_name='agentrun',
            name='request_id',
            field=models.CharField(max_length=200),
        ),
    ]
