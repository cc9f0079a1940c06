"""The replayed runs by thread (``run_replay_thread_idx``, partial: only
runs with ``replay_of``). The dashboard's conversation counts leave out the
scratch threads of replays; without it each count read the whole run table
(a parallel scan: 108 of the overview's 150 ms at 1 M audit rows). The
index holds the replayed runs only; building it reads the run table once."""

from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('audit', '0019_fk_indexes_covered'),
        ('conversations', '0014_fk_indexes_covered'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.AddIndex(
            model_name='agentrun',
            index=models.Index(condition=models.Q(('replay_of', ''), _negated=True), fields=['thread'], name='run_replay_thread_idx'),
        ),
    ]
