"""A message's ``thread`` and a thread's ``user`` foreign keys lose their
single-column indexes: ``message_thread_id_idx`` (thread, id) and
``conv_user_created_idx`` (user, -created_at) serve every lookup they
served, and each index is written on every new audit row version. A
feedback's ``message`` likewise (``feedback_message_user_uniq``).

Only the indexes are dropped (quick: no table scan). Django's own
``AlterField`` would also drop and re-add the foreign keys, which
re-validates every row under an exclusive lock."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("conversations", "0013_thread_deletion"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="conversation",
                    name="user",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="conversations",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
                migrations.AlterField(
                    model_name="message",
                    name="thread",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="messages",
                        to="conversations.conversation",
                    ),
                ),
                migrations.AlterField(
                    model_name="messagefeedback",
                    name="message",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="feedback",
                        to="conversations.message",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    "DROP INDEX IF EXISTS conversations_conversation_user_id_c3e4e6ca",
                    "CREATE INDEX IF NOT EXISTS conversations_conversation_user_id_c3e4e6ca "
                    "ON conversations_conversation (user_id)",
                ),
                migrations.RunSQL(
                    "DROP INDEX IF EXISTS conversations_message_thread_id_2e6e7032",
                    "CREATE INDEX IF NOT EXISTS conversations_message_thread_id_2e6e7032 "
                    "ON conversations_message (thread_id)",
                ),
                migrations.RunSQL(
                    "DROP INDEX IF EXISTS conversations_messagefeedback_message_id_a169e81a",
                    "CREATE INDEX IF NOT EXISTS conversations_messagefeedback_message_id_a169e81a "
                    "ON conversations_messagefeedback (message_id)",
                ),
            ],
        ),
    ]
