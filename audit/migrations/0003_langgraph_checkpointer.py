"""Create the LangGraph checkpointer's tables on PostgreSQL, so that Django
migrations own the whole schema (R-SCH-1). The saver's own setup is
idempotent and versioned; under SQLite the quick start uses an in-memory
saver and this migration does nothing."""

from django.db import migrations


def setup_checkpointer(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    from audit.execution.checkpoint import postgres_conninfo, setup_postgres_checkpointer

    setup_postgres_checkpointer(postgres_conninfo(schema_editor.connection.alias))


class Migration(migrations.Migration):
    dependencies = [("audit", "0002_initial")]

    operations = [migrations.RunPython(setup_checkpointer, migrations.RunPython.noop, elidable=False)]
