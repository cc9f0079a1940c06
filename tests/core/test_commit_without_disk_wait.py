"""core.db.commit_without_disk_wait: one transaction's commit does not wait
for the WAL flush; the session's setting is back after it (R-OTEL-1)."""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from core.db import commit_without_disk_wait

pytestmark = pytest.mark.django_db(transaction=True)


def _setting() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        return cursor.fetchone()[0]


def test_only_the_transaction_commits_without_waiting_for_the_disk():
    assert _setting() == "on"
    with transaction.atomic():
        commit_without_disk_wait()
        assert _setting() == "off"
    assert _setting() == "on"


def test_outside_an_atomic_block_it_refuses():
    with pytest.raises(transaction.TransactionManagementError):
        commit_without_disk_wait()
    assert _setting() == "on"


def test_inside_a_savepoint_it_leaves_the_outer_transaction_alone():
    with transaction.atomic():
        with transaction.atomic():
            commit_without_disk_wait()
        assert _setting() == "on", "the outer transaction's other writes still wait for the disk"
