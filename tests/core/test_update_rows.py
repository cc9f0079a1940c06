"""``core.db.update_rows``: ``bulk_update``'s answer in one ``UPDATE …
FROM (VALUES …)`` per 500 rows (issue 38 item 3, the purge)."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from conversations.models import Conversation
from core.db import update_rows

pytestmark = pytest.mark.django_db


def test_update_rows_saves_the_named_fields_as_a_save_would_in_batches_of_500(user):
    threads = Conversation.objects.bulk_create(
        Conversation(user=user, agent_id="assistant", model="replay:plain_answer", title=f"t{i}") for i in range(501)
    )
    when = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    for i, thread in enumerate(threads):
        # A character PostgreSQL cannot store (kept by the storable escape),
        # a NULL, a value; the agent is changed but not named: not saved.
        thread.title = f"new\x00{i}"
        thread.erased_at = None if i % 2 else when
        thread.agent_id = "researcher"
    with CaptureQueriesContext(connection) as queries:
        update_rows(threads, ["title", "erased_at"])
    assert len([q for q in queries.captured_queries if q["sql"].startswith("UPDATE")]) == 2
    stored = {t.pk: t for t in Conversation.objects.filter(pk__in=[t.pk for t in threads])}
    for i, thread in enumerate(threads):
        row = stored[thread.pk]
        assert (row.title, row.erased_at, row.agent_id) == (f"new\x00{i}", None if i % 2 else when, "assistant")


def test_update_rows_of_nothing_sends_nothing():
    with CaptureQueriesContext(connection) as queries:
        update_rows([], ["title"])
    assert queries.captured_queries == []
