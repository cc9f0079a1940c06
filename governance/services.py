"""Retention (R-GOV-1) and erasure (R-GOV-2): short batches, each one
transaction past the append-only triggers under a recorded
:class:`GovernanceAction`, re-sealing every run it changed (R-GOV-3).

Both are resumable: what they select is what still has a payload, so
running the same command again after an interruption goes on where it
stopped. One purge or erasure runs at a time (a PostgreSQL advisory lock).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from audit.errors import RunNotCancellable
from audit.ledger.locks import web_lock_wait
from audit.ledger.runs import run_request_cancel
from audit.models import AgentRun, RunReplay
from conversations.models import ApiToken, Conversation, Message, MessageFeedback
from core.config import get_config
from core.db import update_rows
from core.errors import NotFound
from core.redis_client import REDIS_CLIENT_OPTIONS, stream_key
from core.workspace import (
    LARGE_RESULTS_DIR,
    OUTBOX_DIR,
    execution_file_name,
    legacy_large_result_path,
    thread_workspace,
)
from webhooks.models import WebhookDelivery

from . import payloads
from .bypass import open_bypass
from .errors import GovernanceBusy, InvalidInput, RunActive, RunStillActive, UnknownUser
from .models import GovernanceAction, RunReseal
from .seal import audit_row_facts, check_run, run_facts, seal_run

# The fields seal_run sets on a run.
_SEAL_FIELDS = ("seal_head", "seal_row_count", "seal_rows", "seal_version", "sealed_at")

log = logging.getLogger(__name__)

_LOCK_KEY = 0x59475F474F56  # "YG_GOV": one purge or erasure at a time
LANGGRAPH_CHECKPOINT_TABLES = ("checkpoint_writes", "checkpoint_blobs", "checkpoints")

Progress = Callable[[int, int], None]


@dataclass
class Outcome:
    """What a purge or erasure did (or, with ``dry_run``, would do)."""

    dry_run: bool
    runs: int = 0
    rows: int = 0
    files: int = 0
    runs_skipped: list = field(default_factory=list)
    action: GovernanceAction | None = None
    extra: dict = field(default_factory=dict)


@contextlib.contextmanager
def _exclusive() -> Iterator[None]:
    if connection.vendor != "postgresql":
        yield
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", [_LOCK_KEY])
        if not cursor.fetchone()[0]:
            raise GovernanceBusy("another purge or erasure is in progress")
    try:
        # Actions left open by a process that died cannot be running now
        # (it would hold the lock): close them, so their bypass ends.
        GovernanceAction.objects.open().exclude(kind=GovernanceAction.Kind.MANUAL).update(
            status=GovernanceAction.Status.STOPPED, finished_at=timezone.now()
        )
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [_LOCK_KEY])


def _finish(action: GovernanceAction, status: str) -> None:
    action.status = status
    action.finished_at = timezone.now()
    action.save(update_fields=["status", "finished_at"])


def _reseal(action: GovernanceAction, runs: list[AgentRun], verified: dict) -> None:
    """Seal ``runs`` again after their rows changed, keeping each previous
    head in a :class:`RunReseal` of ``action``. Unsealed runs (ended before
    sealing existed) stay unsealed. Three statements for the whole batch:
    the rows as they are now (the changes of this transaction), the seals,
    the reseal records."""
    sealed = [run for run in runs if run.sealed_at is not None]
    if not sealed:
        return
    facts = audit_row_facts([run.pk for run in sealed])
    reseals = []
    for run in sealed:
        previous_head, previous_count = run.seal_head, run.seal_row_count
        seal = seal_run(run, rows=facts[run.pk])
        reseals.append(
            RunReseal(
                action=action,
                run_id=run.pk,
                previous_head=previous_head,
                previous_row_count=previous_count,
                previous_verified=verified.get(run.pk, True),
                head=seal.head,
                row_count=seal.row_count,
            )
        )
    update_rows(sealed, _SEAL_FIELDS)
    RunReseal.objects.bulk_create(reseals)


def _verified(runs: list[AgentRun]) -> dict:
    """``{run id: rows still match the seal}`` for the sealed ``runs``."""
    sealed = [run for run in runs if run.sealed_at is not None]
    rows = audit_row_facts([run.pk for run in sealed]) if sealed else {}
    return {
        run.pk: not check_run(
            run.pk,
            run.seal_head,
            run.seal_row_count,
            run.seal_rows,
            rows.get(run.pk, []),
            version=run.seal_version,
            run=run_facts(run),
        )
        for run in sealed
    }


def _execution_files(thread_id, run_id, tool_call_ids: list[str]) -> list[Path]:
    """The workspace files written by executions of ``run_id`` (R-TA-7)
    and, for results written before per-execution naming, their legacy
    paths."""
    workspace = thread_workspace(thread_id)
    run_dir = execution_file_name(str(run_id))
    paths = [workspace / LARGE_RESULTS_DIR / run_dir, workspace / OUTBOX_DIR / run_dir]
    for call_id in tool_call_ids:
        paths.append(workspace / legacy_large_result_path(call_id))
        paths.append(workspace / OUTBOX_DIR / f"{execution_file_name(call_id)}.json")
    return [path for path in paths if path.exists()]


def _delete_files(paths: list[Path]) -> int:
    deleted = 0
    for path in paths:
        try:
            if path.is_dir():
                deleted += sum(1 for p in path.rglob("*") if p.is_file())
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
                deleted += 1
        except FileNotFoundError:
            continue
    return deleted


# --------------------------------------------------------------------------
# Retention (R-GOV-1)
# --------------------------------------------------------------------------


def _purgeable_rows(cutoff: datetime):
    return (
        Message.objects.audit()
        .filter(run__status__in=AgentRun.TERMINAL_STATUSES, run__finished_at__lt=cutoff)
        .exclude(metadata__has_key=payloads.PURGED)
        .exclude(metadata__has_key=payloads.ERASED)
        # A run still awaiting approval keeps the declarations its resume
        # matches decisions against (R-TA-5).
        .exclude(run__status=AgentRun.Status.INTERRUPTED, run__resumed_by__isnull=True)
    )


def payloads_purge(
    *,
    older_than_days: int,
    actor: str,
    dry_run: bool = False,
    batch_runs: int = 50,
    progress: Progress | None = None,
    now: datetime | None = None,
    max_batches: int | None = None,
) -> Outcome:
    """Purge the payloads of the audit rows of terminal runs that finished
    more than ``older_than_days`` days ago (R-GOV-1).

    Per row: content, tool input, declared tool call arguments, raw output
    and the metadata that quotes them are emptied; ids, status, timing,
    usage, cost and tool names stay, and ``metadata.payload_purged_at``
    says when (API and admin: "payload purged on <date>"). The runs'
    workspace files are deleted after each batch commits. Each batch of
    ``batch_runs`` runs is one short transaction that locks those runs,
    checks their seals, purges, re-seals (the previous head kept in a
    :class:`RunReseal`) and adds to the action's counts; a run whose rows no
    longer match its seal is skipped and reported (a purge never launders a
    changed run). ``progress(done runs, total runs)`` is called after each
    batch. ``max_batches`` stops early (what an interruption does; the next
    call goes on).

    Raises:
        InvalidInput: ``older_than_days`` is negative or not an integer.
        GovernanceBusy: another purge or erasure is running.

    Returns the :class:`Outcome`; with ``dry_run`` nothing is changed or
    recorded and the outcome counts what would be purged.
    """
    if isinstance(older_than_days, bool) or not isinstance(older_than_days, int) or older_than_days < 0:
        raise InvalidInput(f"--older-than-days must be a whole number of days >= 0, not {older_than_days!r}")
    now = now or timezone.now()
    cutoff = now - timedelta(days=older_than_days)
    rows = _purgeable_rows(cutoff)
    run_ids = list(rows.order_by("run_id").values_list("run_id", flat=True).distinct())
    outcome = Outcome(dry_run=dry_run, runs=len(run_ids))
    outcome.extra["cutoff"] = cutoff
    if dry_run:
        outcome.rows = rows.count()
        return outcome
    outcome.runs = 0
    with _exclusive():
        action = GovernanceAction.objects.create(
            kind=GovernanceAction.Kind.PURGE,
            actor=actor,
            criterion={"older_than_days": older_than_days, "cutoff": cutoff.isoformat()},
        )
        outcome.action = action
        status = GovernanceAction.Status.STOPPED
        try:
            for index, start in enumerate(range(0, len(run_ids), batch_runs)):
                if max_batches is not None and index >= max_batches:
                    break
                batch = run_ids[start : start + batch_runs]
                changed, files = _purge_batch(action, batch, cutoff=cutoff, now=now, outcome=outcome)
                outcome.files += _delete_files(files)
                GovernanceAction.objects.filter(pk=action.pk).update(files_deleted=outcome.files)
                if progress:
                    progress(min(start + len(batch), len(run_ids)), len(run_ids))
            else:
                status = GovernanceAction.Status.COMPLETED
        finally:
            action.refresh_from_db()
            _finish(action, status)
    return outcome


def _purge_batch(action, run_ids: list, *, cutoff: datetime, now: datetime, outcome: Outcome):
    files: list[Path] = []
    with transaction.atomic():
        open_bypass(action)
        # Terminal runs: no worker writes them; the lock keeps a concurrent
        # erasure or a second purge out of the same rows.
        runs = list(AgentRun.objects.select_for_update(no_key=True, of=("self",)).filter(pk__in=run_ids).order_by("pk"))
        verified = _verified(runs)
        skipped = [run for run in runs if not verified.get(run.pk, True)]
        for run in skipped:
            log.warning("purge skips run %s: its rows no longer match its seal (run verify_audit)", run.pk)
        outcome.runs_skipped += [run.pk for run in skipped]
        runs = [run for run in runs if verified.get(run.pk, True)]
        rows = list(_purgeable_rows(cutoff).filter(run__in=runs))
        fields: list[str] = []
        for row in rows:
            fields = payloads.purge_row(row, at=now)
        if rows:
            update_rows(rows, fields)
        touched = {row.run_id for row in rows}
        changed = [run for run in runs if run.pk in touched]
        _reseal(action, changed, verified)
        GovernanceAction.objects.filter(pk=action.pk).update(
            rows_changed=F("rows_changed") + len(rows),
            runs_resealed=F("runs_resealed") + sum(1 for run in changed if run.sealed_at is not None),
            runs_skipped=F("runs_skipped") + len(skipped),
        )
        calls: dict = {}
        for row in rows:
            if row.role == Message.Role.TOOL:
                calls.setdefault((row.thread_id, row.run_id), []).append(row.operation_id)
        for run in changed:
            files += _execution_files(run.thread_id, run.pk, calls.get((run.thread_id, run.pk), []))
    outcome.runs += len(changed)
    outcome.rows += len(rows)
    return changed, files


# --------------------------------------------------------------------------
# Erasure (R-GOV-2)
# --------------------------------------------------------------------------


def erasure_subject(username: str):
    """The user named ``username``. Raises :class:`UnknownUser`."""
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        raise UnknownUser(f"no user named {username!r}")
    return user


def user_erase(*, username: str, actor: str, dry_run: bool = False, batch_runs: int = 50, progress=None) -> Outcome:
    """Erase everything one user wrote or was answered (R-GOV-2): the
    content of their messages and audit rows (model answers, tool input,
    arguments and output), their runs' input, pending approvals and error
    texts, their feedback reasons and thread titles, the LangGraph
    checkpoints of their threads, their threads' workspace files and their
    live event streams. Anonymous metadata stays for statistics (ids,
    status, timing, usage, cost, tool names, ratings); the account is kept
    as ``erased-user-<id>``, inactive, without password, e-mail, names or
    API tokens. Every run changed is sealed again (R-GOV-3); the erasure is
    recorded as a :class:`GovernanceAction` that names the user by id only.
    Replays of their runs (R-REPLAY-2) are erased with them: their scratch
    threads, runs and reports.

    Runs in batches of ``batch_runs`` runs, one transaction each; running
    it again after an interruption goes on (the account is renamed last).

    Raises:
        UnknownUser: no such user.
        RunStillActive: one of the user's runs is not terminal (nothing
            is changed; cancel it or wait).
        GovernanceBusy: another purge or erasure is running.
    """
    user = erasure_subject(username)
    threads = _with_replay_threads(list(Conversation.objects.filter(user=user).values_list("pk", flat=True)))
    active = AgentRun.objects.filter(Q(user=user) | Q(thread__in=threads)).active()
    if active.exists():
        raise RunStillActive(
            f"user {username!r} has {active.count()} run(s) not yet terminal (e.g. {active.first().pk}); "
            "cancel them or wait, then erase",
            extra={"runs": [str(pk) for pk in active.values_list("pk", flat=True)[:20]]},
        )
    run_ids = list(
        AgentRun.objects.filter(Q(user=user) | Q(thread__in=threads)).order_by("pk").values_list("pk", flat=True)
    )
    messages = Message.objects.filter(thread__in=threads)
    outcome = Outcome(dry_run=dry_run, runs=len(run_ids))
    outcome.extra = {"threads": len(threads), "user_id": user.pk}
    if dry_run:
        outcome.rows = messages.count()
        outcome.files = sum(
            sum(1 for p in thread_workspace(t).rglob("*") if p.is_file())
            for t in threads
            if thread_workspace(t).exists()
        )
        return outcome
    outcome.runs = 0
    with _exclusive(), _erasure(actor=actor, user_id=user.pk, criterion={"user_id": user.pk}) as action:
        outcome.action = action
        _erase_content(
            action,
            threads=threads,
            run_ids=run_ids,
            feedback=Q(user=user) | Q(message__thread__in=threads),
            now=timezone.now(),
            outcome=outcome,
            batch_runs=batch_runs,
            progress=progress,
        )
        with transaction.atomic():
            _anonymize_account(user)
            GovernanceAction.objects.filter(pk=action.pk).update(files_deleted=outcome.files)
    return outcome


@contextlib.contextmanager
def _erasure(*, actor: str, user_id: int, criterion: dict) -> Iterator[GovernanceAction]:
    """A recorded erasure of ``user_id``'s content selected by ``criterion``:
    ``completed`` when the block ends, ``stopped`` when it raises."""
    action = GovernanceAction.objects.create(
        kind=GovernanceAction.Kind.ERASURE, actor=actor, subject_user_id=user_id, criterion=criterion
    )
    status = GovernanceAction.Status.STOPPED
    try:
        yield action
        status = GovernanceAction.Status.COMPLETED
    finally:
        action.refresh_from_db()
        _finish(action, status)


# --------------------------------------------------------------------------
# Thread deletion (R-API-1): the erasure of R-GOV-2, scoped to one thread
# --------------------------------------------------------------------------

# How long a deletion with ``cancel`` waits for the cancelled runs to end
# (their workers stop at the next event boundary) before it answers that
# the erasure will follow (the sweep, ``deleted_threads_erase``).
CANCEL_WAIT_SECONDS = 5.0


@dataclass(frozen=True)
class ThreadDeletion:
    """What :func:`thread_delete` did: the thread is deleted (gone from the
    API); ``erased`` says whether its content is erased already, or waits
    for its runs to end; ``cancelled_runs`` are the runs it asked to cancel."""

    thread_id: uuid.UUID
    erased: bool
    cancelled_runs: list[uuid.UUID]


def thread_delete(*, user, thread_id: uuid.UUID, actor: str, cancel: bool = False) -> ThreadDeletion:
    """Delete one of ``user``'s threads (R-API-1): from this moment it is
    gone from the API (404 everywhere, no new turn, no resume), and its
    content is erased as :func:`user_erase` erases a user's (R-GOV-2:
    messages and audit payloads, run inputs, feedback reasons, the title,
    checkpoints, workspace files, live event streams, replays of its runs),
    keeping the anonymous facts for statistics and re-sealing its runs
    (R-GOV-3) under a recorded :class:`GovernanceAction`
    (``criterion: {"thread_id": ...}``).

    With a run pending or running the thread is refused, unless ``cancel``:
    then those runs are cancelled (R-RUN-6) and the erasure waits up to
    :data:`CANCEL_WAIT_SECONDS` for them to end. Whatever cannot be erased
    at once (runs still ending, another purge or erasure in progress) is
    erased by :func:`deleted_threads_erase`, which Celery beat runs every
    minute.

    Raises:
        NotFound: no such thread of ``user`` (another user's, or deleted).
        RunActive: a run of the thread is pending or running and ``cancel``
            is false (409 ``run_active``, ``runs``: their ids; nothing changed).
        RunBusy: the thread row was not granted within ``WEB_LOCK_TIMEOUT_MS``
            (503, nothing changed).
    """
    with web_lock_wait():
        # As a submission locks it: no turn starts on the thread while it is
        # being deleted, and none after (the thread is no longer visible).
        thread = Conversation.objects.select_for_update(no_key=True).visible_to(user).filter(pk=thread_id).first()
        if thread is None:
            raise NotFound("thread not found")
        active = [str(pk) for pk in AgentRun.objects.filter(thread=thread).active().values_list("pk", flat=True)]
        if active and not cancel:
            raise RunActive(
                f"the thread has {len(active)} run(s) pending or running; wait for them to end, or delete with "
                "cancel=true to cancel them",
                extra={"runs": active},
            )
        thread.status = Conversation.Status.DELETED
        thread.save(update_fields=["status", "updated_at"])
    for run_id in active:
        with contextlib.suppress(RunNotCancellable):  # it ended meanwhile
            run_request_cancel(user=user, run_id=run_id)
    deadline = time.monotonic() + (CANCEL_WAIT_SECONDS if active else 0)
    while AgentRun.objects.filter(pk__in=active).active().exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    erased = thread.pk in deleted_threads_erase(actor=actor, thread_ids=[thread.pk])
    return ThreadDeletion(thread_id=thread.pk, erased=erased, cancelled_runs=[uuid.UUID(pk) for pk in active])


def deleted_threads_erase(*, actor: str, thread_ids: list | None = None, limit: int = 100) -> list[uuid.UUID]:
    """Erase the content of deleted threads (R-API-1) whose runs have all
    ended, and of the replays of their runs (their scratch threads are
    deleted with them); ``thread_ids`` limits it to those threads, else the
    oldest ``limit`` awaiting erasure. One :class:`GovernanceAction` per
    thread; a thread erased is marked ``erased_at``.

    Returns the ids of the threads erased. Never raises for another purge
    or erasure in progress: it returns ``[]`` and a later call goes on."""
    pending = Conversation.objects.awaiting_erasure().order_by("created_at")
    if thread_ids is not None:
        pending = pending.filter(pk__in=thread_ids)
    candidates = list(pending.values_list("pk", "user_id")[:limit])
    if not candidates:
        return []
    erased = []
    try:
        with _exclusive():
            for thread_pk, user_id in candidates:
                threads = _with_replay_threads([thread_pk])
                if AgentRun.objects.filter(thread__in=threads).active().exists():
                    continue  # its runs are still ending: a later pass
                _thread_erase(thread_pk, threads, user_id=user_id, actor=actor)
                erased.append(thread_pk)
    except GovernanceBusy:
        log.info("erasure of deleted threads postponed: another purge or erasure is running")
    return erased


def _thread_erase(thread_pk, threads: list, *, user_id: int, actor: str) -> None:
    run_ids = list(AgentRun.objects.filter(thread__in=threads).order_by("pk").values_list("pk", flat=True))
    with _erasure(actor=actor, user_id=user_id, criterion={"thread_id": str(thread_pk)}) as action:
        outcome = Outcome(dry_run=False)
        now = timezone.now()
        _erase_content(
            action,
            threads=threads,
            run_ids=run_ids,
            feedback=Q(message__thread__in=threads),
            now=now,
            outcome=outcome,
            batch_runs=50,
            progress=None,
        )
        with transaction.atomic():
            Conversation.objects.filter(pk__in=threads).update(status=Conversation.Status.DELETED, erased_at=now)
            GovernanceAction.objects.filter(pk=action.pk).update(files_deleted=outcome.files)


def _with_replay_threads(threads: list) -> list:
    """``threads`` and the scratch threads of the replays of their runs
    (R-REPLAY-2: a replay copies what the recorded runs said onto a thread
    of the replay user, ``AgentRun.replay_of`` naming the recorded run),
    and of replays of those, to the end. A replay of a scenario file names
    the file, not a run: what was exported to a file is out of reach."""
    found = list(threads)
    frontier = list(threads)
    while frontier:
        run_ids = [str(pk) for pk in AgentRun.objects.filter(thread__in=frontier).values_list("pk", flat=True)]
        frontier = list(
            AgentRun.objects.filter(replay_of__in=run_ids)
            .exclude(thread__in=found)
            .values_list("thread_id", flat=True)
            .distinct()
        )
        found += frontier
    return found


def _erase_batch(action, run_ids: list, *, now: datetime, outcome: Outcome) -> None:
    with transaction.atomic():
        open_bypass(action)
        runs = list(AgentRun.objects.select_for_update(no_key=True, of=("self",)).filter(pk__in=run_ids).order_by("pk"))
        verified = _verified(runs)
        for run_pk, ok in verified.items():
            if not ok:
                log.warning("erasure of run %s: its rows no longer matched its seal before erasing", run_pk)
                outcome.runs_skipped.append(run_pk)
        rows = list(Message.objects.filter(run__in=runs).exclude(metadata__has_key=payloads.ERASED))
        fields: list[str] = []
        for row in rows:
            fields = payloads.erase_row(row, at=now)
        if rows:
            update_rows(rows, fields)
        for run in runs:
            run.save(update_fields=payloads.erase_run_input(run))
        _reseal(action, runs, verified)
        GovernanceAction.objects.filter(pk=action.pk).update(
            rows_changed=F("rows_changed") + len(rows),
            runs_resealed=F("runs_resealed") + sum(1 for run in runs if run.sealed_at is not None),
            runs_skipped=F("runs_skipped") + sum(1 for ok in verified.values() if not ok),
        )
    outcome.runs += len(runs)
    outcome.rows += len(rows)


def _erase_content(
    action, *, threads: list, run_ids: list, feedback: Q, now: datetime, outcome: Outcome, batch_runs: int, progress
) -> None:
    """Erase the content of ``threads`` and ``run_ids`` under ``action``:
    the runs in batches of ``batch_runs`` (one transaction each), then what
    is not in a run (reasons of the ``feedback`` selected too), the threads'
    workspace files and the runs' live event streams."""
    for start in range(0, len(run_ids), batch_runs):
        _erase_batch(action, run_ids[start : start + batch_runs], now=now, outcome=outcome)
        if progress:
            progress(min(start + batch_runs, len(run_ids)), len(run_ids))
    _erase_rest(action, feedback, threads, now=now, outcome=outcome)
    outcome.files = _delete_files([thread_workspace(t) for t in threads if thread_workspace(t).exists()])
    _erase_event_streams(run_ids)


def _erase_rest(action, feedback: Q, threads: list, *, now: datetime, outcome: Outcome) -> None:
    """What is not in a run: messages without a run, the reasons of the
    ``feedback`` selected, thread titles, replay reports, webhook URLs
    (pending deliveries skipped), checkpoints, admin log texts."""
    from django.contrib.admin.models import LogEntry
    from django.contrib.contenttypes.models import ContentType

    with transaction.atomic():
        open_bypass(action)
        rows = list(
            Message.objects.filter(thread__in=threads, run__isnull=True).exclude(metadata__has_key=payloads.ERASED)
        )
        fields: list[str] = []
        for row in rows:
            fields = payloads.erase_row(row, at=now)
        if rows:
            update_rows(rows, fields)
        MessageFeedback.objects.filter(feedback).exclude(reason="").update(reason="")
        Conversation.objects.filter(pk__in=threads).exclude(title="").update(title="")
        # A replay report quotes what the runs said (R-REPLAY-2).
        RunReplay.objects.filter(run__thread__in=threads).update(report="", first_divergence="")
        # Where the runs' ends were announced (R-API-3): a URL may name the
        # user. A delivery not sent yet is not sent any more.
        AgentRun.objects.filter(thread__in=threads).exclude(webhook="").update(webhook="")
        deliveries = WebhookDelivery.objects.filter(run__thread__in=threads)
        deliveries.filter(status=WebhookDelivery.Status.PENDING).update(
            status=WebhookDelivery.Status.SKIPPED, last_error="the run's content was erased: not sent"
        )
        deliveries.exclude(url="").update(url="")
        for model in (Conversation, Message, AgentRun):
            LogEntry.objects.filter(content_type=ContentType.objects.get_for_model(model)).filter(
                object_id__in=[str(t) for t in threads]
                if model is Conversation
                else [str(pk) for pk in model.objects.filter(thread__in=threads).values_list("pk", flat=True)]
            ).update(object_repr="(erased)", change_message="")
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                for table in LANGGRAPH_CHECKPOINT_TABLES:
                    cursor.execute("SELECT to_regclass(%s)", [table])
                    if cursor.fetchone()[0] is not None:
                        cursor.execute(f"DELETE FROM {table} WHERE thread_id = ANY(%s)", [[str(t) for t in threads]])
        GovernanceAction.objects.filter(pk=action.pk).update(rows_changed=F("rows_changed") + len(rows))
    outcome.rows += len(rows)


def _erase_event_streams(run_ids: list) -> None:
    """The runs' live event streams (text deltas) in Redis, if reachable."""
    url = get_config().REDIS_URL
    if not url or not run_ids:
        return
    try:
        import redis

        client = redis.Redis.from_url(url, **REDIS_CLIENT_OPTIONS)
        try:
            for start in range(0, len(run_ids), 500):
                client.delete(*[stream_key(pk) for pk in run_ids[start : start + 500]])
        finally:
            client.close()
    except Exception:  # the streams expire by themselves within a day
        log.warning("could not delete the live event streams of an erased user", exc_info=True)


def _anonymize_account(user) -> None:
    user.username = f"erased-user-{user.pk}"
    for name in ("email", "first_name", "last_name"):
        if hasattr(user, name):
            setattr(user, name, "")
    user.is_active = False
    user.set_unusable_password()
    user.save()
    ApiToken.objects.filter(user=user).delete()
