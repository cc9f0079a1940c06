"""Find audit rows by their words and ids (R-ADM-2), and place rejected
approval rows at the point of the decision (R-TA-5).

* ``search_vector``: a stored generated ``tsvector`` of the row's content,
  tool name, tool input and declared tool calls, in PostgreSQL's
  language-neutral ``simple`` configuration (no stemming, no stop words: it
  works for any language), with a GIN index. It is not a model field on
  purpose: the application only matches it (``audit.search``), and a model
  field would be sent back by every INSERT and UPDATE of the hot audit
  write path and read by every timeline query. Each part is cut to a
  bounded length so that no row, however large, exceeds PostgreSQL's 1 MB
  ``tsvector`` limit and fails its audit write; words past the cut are not
  searchable (the row keeps its full content).
* ``message_operation_idx``: exact operation id (tool call id, model call
  id) across runs, for the admin and API search.
* Rejected tool rows written before this change get ``sequence = 0``.

On the embedded SQLite default the vector and its index are skipped; the
search falls back to an unindexed ``LIKE`` there.
"""

from django.db import migrations, models

SEARCH_VECTOR_SQL = """
ALTER TABLE conversations_message ADD COLUMN search_vector tsvector GENERATED ALWAYS AS (
    to_tsvector(
        'simple'::regconfig,
        left(coalesce(content, ''), 60000) || ' ' || coalesce(tool_name, '') || ' '
        || left(coalesce(tool_input::text, ''), 10000) || ' ' || left(coalesce(tool_calls::text, ''), 10000)
    )
) STORED;
CREATE INDEX message_search_idx ON conversations_message USING gin (search_vector);
"""

DROP_SEARCH_VECTOR_SQL = """
DROP INDEX IF EXISTS message_search_idx;
ALTER TABLE conversations_message DROP COLUMN IF EXISTS search_vector;
"""


def add_search_vector(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(SEARCH_VECTOR_SQL)


def drop_search_vector(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP_SEARCH_VECTOR_SQL)


def order_rejected_rows(apps, schema_editor):
    Message = apps.get_model("conversations", "Message")
    Message.objects.filter(
        execution_status="rejected", sequence__isnull=True, metadata__source="approval_decision"
    ).update(sequence=0)


class Migration(migrations.Migration):
    dependencies = [
        ("conversations", "0003_message_cost"),
    ]

    operations = [
        migrations.RunPython(add_search_vector, drop_search_vector, elidable=False),
        migrations.AddIndex(
            model_name="message",
            index=models.Index(
                condition=models.Q(("operation_id__isnull", False)),
                fields=["operation_id"],
                name="message_operation_idx",
            ),
        ),
        migrations.RunPython(order_rejected_rows, migrations.RunPython.noop),
    ]
