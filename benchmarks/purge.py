"""The payload purge against the same work done by hand (``python manage.py
bench_purge``, R-GOV-1, R-GOV-3, issue 38 item 3).

Drives sealed runs through the real services (lease, model and tool rows
closed by their lifecycles, ``run_finish``), then, in alternating rounds,
purges a fresh set of them each way:

* the product: :func:`governance.services.payloads_purge` in batches of
  ``batch_runs`` runs;
* the baseline, the same work in the cheapest way: one recorded purge
  action; per batch of the same size one transaction that opens the
  audited bypass, locks the batch's runs in key order (``FOR NO KEY
  UPDATE``, one statement that reads their facts and seals), checks each
  seal with the product's check (:func:`governance.seal.audit_row_facts`,
  :func:`governance.seal.check_run`), empties the same columns with one
  ``UPDATE … FROM (VALUES …)`` (each row's new tool calls and metadata made
  by :func:`governance.payloads.purge_row`), reads the rows again and
  recomputes each seal with :func:`governance.seal.compute_seal`, stores
  the seals with one more ``UPDATE … FROM (VALUES …)``, inserts the
  :class:`governance.models.RunReseal` rows and adds to the action's
  counts; after the commit it looks for the runs' workspace files.

A comparison without the re-seal (the issue's "raw batch of the same
updates") measures less work than the purge promises; this one does not.

Only the benchmark's runs are old enough to purge: right before each pass
its set's end (``finished_at``) is moved to :data:`AGED` and the set is
sealed again, through the recorded bypass, and the purge runs with a
``now`` just after it. The figure is audit rows purged per second of wall
time of the whole pass (and runs per second). With ``profile`` one more
product pass runs under cProfile, unmeasured. Creates a throw-away user,
threads and runs and deletes them at the end through the recorded bypass,
then recomputes the dashboard's rollups of the days it ran; the purge
actions stay recorded (Data governance → Governance actions). A
benchmark, not a test: it prints figures and asserts nothing.
"""

from __future__ import annotations

import cProfile
import datetime as dt
import io
import json
import pstats
import shutil
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from audit import ledger
from audit.models import AgentRun
from conversations.models import Conversation, Message
from core.workspace import (
    LARGE_RESULTS_DIR,
    OUTBOX_DIR,
    execution_file_name,
    legacy_large_result_path,
    thread_workspace,
)
from governance import payloads
from governance.bypass import audited_bypass, open_bypass
from governance.models import GovernanceAction, RunReseal
from governance.seal import RUN_FACT_FIELDS, audit_row_facts, check_run, compute_seal, seal_run
from governance.services import payloads_purge

from .databases import throwaway_user_delete
from .seal import _driven_run

#: Where the benchmark moves its runs' end: older than any real run, so
#: that a purge with a cutoff just after it touches the benchmark's only.
AGED = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
_NOW = AGED + dt.timedelta(days=2)
_OLDER_THAN_DAYS = 1
_ACTOR = "bench_purge"


@dataclass(frozen=True)
class PurgeBench:
    """Rows and runs purged per second by each pass (one per round each
    way); ``rows_per_pass`` audit rows of ``runs`` runs per pass;
    ``profile`` is the cProfile top 15 by cumulative time of one more
    product pass ("" unless asked)."""

    runs: int
    rows_per_run: int
    batch_runs: int
    rows_per_pass: int
    product_rows_per_s: list[float]
    baseline_rows_per_s: list[float]
    product_runs_per_s: list[float]
    baseline_runs_per_s: list[float]
    profile: str = ""

    @property
    def product_median(self) -> float:
        return statistics.median(self.product_rows_per_s)

    @property
    def baseline_median(self) -> float:
        return statistics.median(self.baseline_rows_per_s)

    @property
    def ratio_median(self) -> float:
        """Median over the rounds of product / baseline rows per second."""
        return statistics.median(p / b for p, b in zip(self.product_rows_per_s, self.baseline_rows_per_s, strict=True))


def _sealed_runs(user, *, runs: int, rows: int) -> list[uuid.UUID]:
    ids = []
    for _ in range(runs):
        thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
        run, lease, state = _driven_run(user, thread, rows)
        ledger.run_finish(lease=lease, status="completed", final_state=state)
        ids.append(run.pk)
    return ids


def _age(run_ids: list[uuid.UUID]) -> None:
    """Move the runs' end to :data:`AGED` and seal them again, as if they
    had ended then."""
    with audited_bypass(reason="bench_purge: date its throw-away runs back, so that only they are purged"):
        AgentRun.objects.filter(pk__in=run_ids).update(finished_at=AGED)
        for run in AgentRun.objects.filter(pk__in=run_ids):
            seal_run(run, save=True)


# --------------------------------------------------------------------------
# Baseline: the purge's promises, by hand
# --------------------------------------------------------------------------

_SEAL_FIELDS = ("seal_head", "seal_row_count", "seal_rows", "seal_version", "sealed_at")

_UPDATE_ROWS = """
UPDATE conversations_message AS m
SET content = '', tool_input = NULL, tool_calls = v.tool_calls, metadata = v.metadata
FROM (VALUES {values}) AS v (id, tool_calls, metadata)
WHERE m.id = v.id
"""
_UPDATE_SEALS = """
UPDATE audit_agentrun AS r
SET seal_head = v.head, seal_row_count = v.row_count, seal_rows = v.seal_rows, seal_version = v.version,
    sealed_at = %s
FROM (VALUES {values}) AS v (id, head, row_count, seal_rows, version)
WHERE r.id = v.id
"""


def _stored(name: str, value):
    # As a save stores it: the storable escapes (R-RUN-11), None as NULL.
    return Message._meta.get_field(name).get_db_prep_save(value, connection)


def _workspace_files(run: dict, tool_call_ids: list[str]) -> list[Path]:
    """The paths the purge deletes for ``run`` that exist (its execution
    directories and, per tool call, the legacy paths)."""
    workspace = thread_workspace(run["thread_id"])
    run_dir = execution_file_name(str(run["id"]))
    paths = [workspace / LARGE_RESULTS_DIR / run_dir, workspace / OUTBOX_DIR / run_dir]
    for call_id in tool_call_ids:
        paths += [
            workspace / legacy_large_result_path(call_id),
            workspace / OUTBOX_DIR / f"{execution_file_name(call_id)}.json",
        ]
    return [path for path in paths if path.exists()]


def _baseline_batch(action: GovernanceAction, run_ids: list, *, at: dt.datetime) -> tuple[int, int]:
    with transaction.atomic():
        open_bypass(action)
        runs = list(
            AgentRun.objects.select_for_update(no_key=True)
            .filter(pk__in=run_ids)
            .order_by("pk")
            .values(*RUN_FACT_FIELDS, *_SEAL_FIELDS)
        )
        facts = audit_row_facts([run["id"] for run in runs])
        kept = [
            run
            for run in runs
            if run["sealed_at"] is None
            or not check_run(
                run["id"],
                run["seal_head"],
                run["seal_row_count"],
                run["seal_rows"],
                facts[run["id"]],
                version=run["seal_version"],
                run=run,
            )
        ]
        changed: list[tuple] = []
        calls: dict = {}
        for run in kept:
            for row in facts[run["id"]]:
                metadata = row["metadata"] or {}
                if row["operation_id"] is None or payloads.PURGED in metadata or payloads.ERASED in metadata:
                    continue
                purged = SimpleNamespace(**row)
                payloads.purge_row(purged, at=at)
                changed.append(
                    (row["id"], _stored("tool_calls", purged.tool_calls), _stored("metadata", purged.metadata))
                )
                calls.setdefault(run["id"], [])
                if row["role"] == "tool":
                    calls[run["id"]].append(row["operation_id"])
        touched = [run for run in kept if run["id"] in calls]
        resealed = [run for run in touched if run["sealed_at"] is not None]
        with connection.cursor() as cursor:
            if changed:
                values = ", ".join(["(%s::bigint, %s::jsonb, %s::jsonb)"] * len(changed))
                cursor.execute(_UPDATE_ROWS.format(values=values), [v for row in changed for v in row])
            stored = audit_row_facts([run["id"] for run in resealed]) if resealed else {}
            seals = [(run, compute_seal(run["id"], stored[run["id"]], run=run)) for run in resealed]
            if seals:
                values = ", ".join(["(%s::uuid, %s, %s::integer, %s::jsonb, %s::integer)"] * len(seals))
                params = [
                    v for run, s in seals for v in (run["id"], s.head, s.row_count, json.dumps(s.rows), s.version)
                ]
                cursor.execute(_UPDATE_SEALS.format(values=values), [timezone.now(), *params])
        RunReseal.objects.bulk_create(
            RunReseal(
                action=action,
                run_id=run["id"],
                previous_head=run["seal_head"],
                previous_row_count=run["seal_row_count"],
                previous_verified=True,
                head=seal.head,
                row_count=seal.row_count,
            )
            for run, seal in seals
        )
        GovernanceAction.objects.filter(pk=action.pk).update(
            rows_changed=F("rows_changed") + len(changed),
            runs_resealed=F("runs_resealed") + len(seals),
            runs_skipped=F("runs_skipped") + len(runs) - len(kept),
        )
        files = [path for run in touched for path in _workspace_files(run, calls[run["id"]])]
    for path in files:  # after the commit, as the purge does
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return len(changed), len(touched)


def _baseline_pass(*, batch_runs: int) -> tuple[int, int]:
    """Purge the aged runs by hand; returns (rows, runs)."""
    cutoff = _NOW - dt.timedelta(days=_OLDER_THAN_DAYS)
    run_ids = list(
        AgentRun.objects.filter(status__in=AgentRun.TERMINAL_STATUSES, finished_at__lt=cutoff)
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    action = GovernanceAction.objects.create(
        kind=GovernanceAction.Kind.PURGE, actor=_ACTOR, criterion={"bench_purge": "baseline"}
    )
    rows = runs = 0
    for start in range(0, len(run_ids), batch_runs):
        batch_rows, batch_resealed = _baseline_batch(action, run_ids[start : start + batch_runs], at=_NOW)
        rows += batch_rows
        runs += batch_resealed
    GovernanceAction.objects.filter(pk=action.pk).update(
        status=GovernanceAction.Status.COMPLETED, finished_at=timezone.now()
    )
    return rows, runs


def _product_pass(*, batch_runs: int) -> tuple[int, int]:
    outcome = payloads_purge(older_than_days=_OLDER_THAN_DAYS, actor=_ACTOR, batch_runs=batch_runs, now=_NOW)
    return outcome.rows, outcome.runs


def _timed(purge, run_ids: list, *, batch_runs: int) -> tuple[float, float, int]:
    _age(run_ids)
    started = time.perf_counter()
    rows, runs = purge(batch_runs=batch_runs)
    elapsed = time.perf_counter() - started
    if runs != len(run_ids):
        raise RuntimeError(f"bench_purge: a pass purged {runs} runs, not its {len(run_ids)}: the figures would lie")
    return rows / elapsed, runs / elapsed, rows


def bench_purge(
    *, runs: int = 100, rows: int = 10, batch_runs: int = 50, rounds: int = 2, profile: bool = False
) -> PurgeBench:
    """Audit rows (and runs) purged per second by :func:`payloads_purge`
    and by the same work done by hand, over ``rounds`` rounds of a fresh
    set of ``runs`` sealed runs of ``rows`` audit rows each way, in batches
    of ``batch_runs`` runs (the product first in even rounds, the baseline
    in odd ones). With ``profile``, the cProfile top 15 (cumulative time)
    of one more product pass."""
    first_day = timezone.now().astimezone(dt.UTC).date()
    user = get_user_model().objects.create_user(username=f"bench-purge-{uuid.uuid4().hex[:10]}")
    figures: dict[str, list[tuple[float, float, int]]] = {"product": [], "baseline": []}
    passes = {"product": _product_pass, "baseline": _baseline_pass}
    profile_text = ""
    try:
        for index in range(rounds):
            order = ("product", "baseline") if index % 2 == 0 else ("baseline", "product")
            for name in order:
                run_ids = _sealed_runs(user, runs=runs, rows=rows)
                figures[name].append(_timed(passes[name], run_ids, batch_runs=batch_runs))
        if profile:
            _age(_sealed_runs(user, runs=runs, rows=rows))
            profiler = cProfile.Profile()
            profiler.runcall(_product_pass, batch_runs=batch_runs)
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(15)
            profile_text = out.getvalue()
    finally:
        throwaway_user_delete(user, bench="bench_purge", since=first_day)
    return PurgeBench(
        runs=runs,
        rows_per_run=rows,
        batch_runs=batch_runs,
        rows_per_pass=figures["product"][0][2],
        product_rows_per_s=[f[0] for f in figures["product"]],
        baseline_rows_per_s=[f[0] for f in figures["baseline"]],
        product_runs_per_s=[f[1] for f in figures["product"]],
        baseline_runs_per_s=[f[1] for f in figures["baseline"]],
        profile=profile_text,
    )
