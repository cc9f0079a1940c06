"""The conversation counts per hour and per UTC day (conversations.triggers)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('dashboard', '0003_fk_indexes_covered'),
    ]

    operations = [
        migrations.CreateModel(
            name='RollupThreadDay',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('day', models.DateField(help_text='UTC calendar day.')),
                ('model', models.CharField(max_length=200)),
                ('agent_id', models.CharField(max_length=100)),
                ('conversations', models.BigIntegerField(db_default=0, default=0)),
            ],
            options={
                'constraints': [models.UniqueConstraint(fields=('day', 'model', 'agent_id'), name='rollup_thread_day_key')],
            },
        ),
        migrations.CreateModel(
            name='RollupThreadHour',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('hour', models.DateTimeField()),
                ('model', models.CharField(max_length=200)),
                ('agent_id', models.CharField(max_length=100)),
                ('conversations', models.BigIntegerField(db_default=0, default=0)),
            ],
            options={
                'constraints': [models.UniqueConstraint(fields=('hour', 'model', 'agent_id'), name='rollup_thread_hour_key')],
            },
        ),
    ]
