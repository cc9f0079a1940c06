"""A payload purge and a rollup rebuild running at once never deadlock
(issue 38 item 3, R-GOV-1, R-DASH-1): both lock run rows in id order.

The rebuild's first step marked every unmarked terminal run in one
``UPDATE`` that locked the rows in the order it scanned them (the order
they were created), against the purge's batch locks in id order; it now
marks them in batches in id order (``mark_terminal_runs``). Here the
runs are created in descending id order and a third session holds the
middle one, so that the two are caught in the interleaving that
deadlocked: the rebuild holds the first-created run and waits for the
middle one, the purge holds the last-created (lowest id) and waits for
the first-created; the third session lets go.
"""

from __future__ import annotations

import threading
import time
import uuid

import psycopg
import pytest
from django.db import connection, connections
from django.utils import timezone

from audit.models import AgentRun
from dashboard.rollups import rollups_rebuild
from governance.services import payloads_purge
from tests.read.builders import tool_turn
from tests.waiting import WAIT_SECONDS

pytestmark = pytest.mark.django_db(transaction=True)

LATER = timezone.now() + timezone.timedelta(days=40)


def _waiting_on_a_lock(admin, text: str) -> bool:
    return bool(
        admin.execute(
            "SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND query LIKE %s",
            [f"{text}%"],
        ).fetchone()
    )


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"waited {WAIT_SECONDS}s for {what}"
        time.sleep(0.02)


def _in_a_thread(target, errors: list) -> threading.Thread:
    def run():
        try:
            target()
        except Exception as exc:  # reported by the test
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_purge_and_a_rollup_rebuild_at_once_do_not_deadlock_R_GOV_1(thread, monkeypatch):
    ids = iter(uuid.UUID(int=n << 120) for n in (0xF0, 0x80, 0x10))
    monkeypatch.setattr(AgentRun._meta.pk, "_get_default", lambda: next(ids))
    runs = [tool_turn(thread, prefix=prefix) for prefix in ("a", "b", "c")]
    monkeypatch.undo()
    first, middle, last = (run.pk for run in runs)
    assert first > middle > last
    # Finished runs are marked as rolled up by their terminal write; the
    # rebuild marks the ones that are not (runs of before the rollups).
    AgentRun.objects.filter(pk__in=[first, middle, last]).update(rolled_up_at=None)

    settings = connection.settings_dict
    params = {"dbname": settings["NAME"], "host": settings["HOST"] or "127.0.0.1", "user": settings["USER"]}
    errors: list = []
    with psycopg.connect(**params, autocommit=True) as admin, psycopg.connect(**params) as holder:
        holder.execute("SELECT 1 FROM audit_agentrun WHERE id = %s FOR NO KEY UPDATE", [middle])
        rebuild = _in_a_thread(rollups_rebuild, errors)
        _wait_until(
            lambda: _waiting_on_a_lock(admin, "WITH batch AS (SELECT id, created_at FROM audit_agentrun"),
            "the rebuild to wait for the held run",
        )
        purge = _in_a_thread(lambda: payloads_purge(older_than_days=1, actor="t", now=LATER), errors)
        # (The purge's statement is longer than what pg_stat_activity keeps.)
        _wait_until(lambda: _waiting_on_a_lock(admin, 'SELECT "audit_agentrun"."id"'), "the purge to wait for a run")
        holder.rollback()
        rebuild.join(WAIT_SECONDS)
        purge.join(WAIT_SECONDS)
    assert not rebuild.is_alive() and not purge.is_alive()
    assert errors == []
    assert AgentRun.objects.filter(pk__in=[first, middle, last], rolled_up_at__isnull=True).count() == 0
