"""Sealed runs (R-GOV-3): a hash chain over a run's closed audit rows.

The terminal transaction calls :func:`seal_run` once every row of the run is
closed. Each audit row (``operation_id`` set, the run's final answer
included) is encoded canonically — ids, role, type, status, sequence,
timestamps, duration, usage (and its cause when set), cost and price,
content, declared tool calls, tool name and input, and the metadata that
carries the raw tool output and the purge and erasure marks — and hashed (``row digest``). The chain starts
from ``SHA-256("yuxi-seal/v1" | run id)``; each link is
``SHA-256(previous link | row digest)`` over the rows in timeline order
(``sequence``, rows without one last, then id). The run keeps the head, the
row count, when it was sealed and ``seal_rows`` — ``[[row id, first 16 hex
digits of the row digest], …]`` — so that a verification names the first
row that differs, not only the run.

A chain without an outside anchor cannot stop someone who rewrites rows
*and* recomputes every seal; it catches every change made behind the
application's back by anything that does not (a manual UPDATE, a restore of
an old row, a deleted row), and the triggers of ``governance.triggers``
refuse those in the first place.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

SEAL_VERSION = b"yuxi-seal/v1"
ROW_DIGEST_CHARS = 16

# Facts added after rows were first sealed under v1: hashed only when set,
# so that a row sealed before the field existed (null there) keeps its
# digest, while setting, changing or clearing one still changes it.
LATER_FACT_FIELDS = frozenset({"usage_cause"})  # R-MA-12

# The facts a seal covers, read the same way by the seal and the check.
FACT_FIELDS = (
    "id",
    "run_id",
    "thread_id",
    "role",
    "message_type",
    "operation_id",
    "sequence",
    "execution_status",
    "started_at",
    "finished_at",
    "duration_ms",
    "usage",
    "usage_cause",
    "cost_usd",
    "price_source",
    "price_version",
    "content",
    "tool_calls",
    "tool_name",
    "tool_input",
    "declared_by_id",
    "metadata",
)


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.astimezone(timezone.UTC).isoformat(timespec="microseconds")
    if isinstance(value, Decimal | uuid.UUID):
        return str(value)
    return value


def row_digest(facts: dict[str, Any]) -> str:
    """SHA-256 (hex) of one row's canonical encoding: JSON with sorted keys,
    no spaces and ASCII escapes (a lone surrogate hashes too, R-RUN-11)."""
    encoded = json.dumps(
        {name: _plain(facts[name]) for name in FACT_FIELDS if facts[name] is not None or name not in LATER_FACT_FIELDS},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
        default=str,
    )
    return hashlib.sha256(encoded.encode("ascii")).hexdigest()


def _timeline_key(facts: dict[str, Any]) -> tuple:
    return (facts["sequence"] is None, facts["sequence"] or 0, facts["id"])


@dataclass
class Seal:
    head: str
    row_count: int
    rows: list[list[Any]] = field(default_factory=list)


def chain(run_id, digests: Iterable[tuple[int, str]]) -> Seal:
    """The seal of ``run_id`` over ``(row id, row digest)`` in timeline order."""
    link = hashlib.sha256(SEAL_VERSION + b"|" + str(run_id).encode()).digest()
    rows = []
    for row_id, digest in digests:
        link = hashlib.sha256(link + bytes.fromhex(digest)).digest()
        rows.append([row_id, digest[:ROW_DIGEST_CHARS]])
    return Seal(head=link.hex(), row_count=len(rows), rows=rows)


def audit_row_facts(run_ids: list) -> dict[Any, list[dict[str, Any]]]:
    """``{run id: [facts of each audit row, in timeline order]}``, one query."""
    from conversations.models import Message

    by_run: dict[Any, list[dict[str, Any]]] = {run_id: [] for run_id in run_ids}
    for facts in Message.objects.audit().filter(run_id__in=run_ids).values(*FACT_FIELDS):
        by_run.setdefault(facts["run_id"], []).append(facts)
    for rows in by_run.values():
        rows.sort(key=_timeline_key)
    return by_run


def compute_seal(run_id, rows: list[dict[str, Any]]) -> Seal:
    return chain(run_id, ((facts["id"], row_digest(facts)) for facts in rows))


def seal_run(run, *, save: bool = False, rows: list[dict[str, Any]] | None = None) -> Seal:
    """Seal a terminal run: hash its audit rows and set ``seal_head``,
    ``seal_row_count``, ``seal_rows`` and ``sealed_at`` on ``run``.

    The terminal transaction calls it with every row closed, the run row
    locked and its terminal fields set, right before it saves the run: the
    seal is written by that same save (one UPDATE of the run, whose status
    and seal change together). A purge or erasure passes ``save=True``
    under the audited bypass, and the seal fields alone are updated. One
    SELECT of the run's audit rows, unless ``rows`` gives their facts (each
    with :data:`FACT_FIELDS` as :func:`audit_row_facts` reads them, in any
    order: the terminal transaction has just read and written them).
    Implements R-GOV-3.
    """
    from audit.models import AgentRun

    rows = audit_row_facts([run.pk])[run.pk] if rows is None else sorted(rows, key=_timeline_key)
    seal = compute_seal(run.pk, rows)
    run.seal_head, run.seal_row_count, run.seal_rows = seal.head, seal.row_count, seal.rows
    run.sealed_at = timezone.now()
    if save:
        AgentRun.objects.filter(pk=run.pk).update(
            seal_head=run.seal_head,
            seal_row_count=run.seal_row_count,
            seal_rows=run.seal_rows,
            sealed_at=run.sealed_at,
        )
    return seal


# --------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """One run whose rows differ from its seal: ``kind`` is ``changed``,
    ``removed``, ``added`` or ``seal`` (the rows match ``seal_rows`` but the
    head does not: the seal itself was edited); ``row`` describes the first
    differing row."""

    run_id: uuid.UUID
    kind: str
    row_id: int | None
    row: str

    def __str__(self) -> str:
        if self.kind == "seal":
            return f"run {self.run_id}: the stored seal was changed ({self.row})"
        return f"run {self.run_id}: row {self.row_id} {self.kind} after sealing ({self.row})"


def _describe(facts: dict[str, Any] | None) -> str:
    if facts is None:
        return "row no longer exists"
    return f"{facts['role']} {facts['operation_id']}, sequence {facts['sequence']}"


def check_run(run_id, head: str, row_count: int, sealed_rows: list, rows: list[dict[str, Any]]) -> Finding | None:
    """Compare a run's rows with its seal; None when they match."""
    digests = [(facts["id"], row_digest(facts)) for facts in rows]
    seal = chain(run_id, digests)
    if seal.head == head and seal.row_count == row_count:
        return None
    by_id = {facts["id"]: facts for facts in rows}
    sealed = [tuple(entry) for entry in sealed_rows or []]
    for position, (row_id, digest) in enumerate(digests):
        if position >= len(sealed):
            return Finding(run_id, "added", row_id, _describe(by_id[row_id]))
        sealed_id, sealed_digest = sealed[position]
        if sealed_id == row_id and sealed_digest == digest[:ROW_DIGEST_CHARS]:
            continue
        if sealed_id == row_id:
            return Finding(run_id, "changed", row_id, _describe(by_id[row_id]))
        if sealed_id not in by_id:
            return Finding(run_id, "removed", sealed_id, "row no longer exists")
        if row_id not in {entry[0] for entry in sealed}:
            return Finding(run_id, "added", row_id, _describe(by_id[row_id]))
        return Finding(run_id, "changed", row_id, _describe(by_id[row_id]) + "; moved in the timeline")
    if len(sealed) > len(digests):
        row_id = sealed[len(digests)][0]
        return Finding(run_id, "removed", row_id, "row no longer exists")
    return Finding(run_id, "seal", None, f"head {head[:16]}…, rows recompute to {seal.head[:16]}…")


@dataclass
class Report:
    checked: int = 0
    sealed: int = 0
    unsealed: int = 0
    findings: list[Finding] = field(default_factory=list)


def verify_runs(runs, *, batch_size: int = 200) -> Iterator[tuple[Report, list]]:
    """Recompute the seals of ``runs`` (an ``AgentRun`` QuerySet of terminal
    runs) in batches of ``batch_size`` runs, keyset-paged by id, one query
    for the runs and one for their rows per batch. Yields ``(report so far,
    the batch's runs)`` after each batch. Runs without a seal (ended before
    sealing existed) are counted as unsealed, not as broken (R-GOV-3)."""
    report = Report()
    last = None
    fields = ("id", "seal_head", "seal_row_count", "seal_rows", "sealed_at")
    while True:
        page = runs.order_by("id")
        if last is not None:
            page = page.filter(id__gt=last)
        # One snapshot per batch: a purge or erasure that re-seals a run
        # between reading the seal and reading the rows is never taken for
        # a change (its rows and seal commit together).
        own_transaction = not connection.in_atomic_block
        with transaction.atomic():
            if own_transaction and connection.vendor == "postgresql":
                with connection.cursor() as cursor:
                    cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            batch = list(page.values(*fields)[:batch_size])
            sealed = [run for run in batch if run["sealed_at"] is not None]
            rows = audit_row_facts([run["id"] for run in sealed]) if sealed else {}
        if not batch:
            return
        last = batch[-1]["id"]
        report.checked += len(batch)
        report.unsealed += len(batch) - len(sealed)
        report.sealed += len(sealed)
        for run in sealed:
            finding = check_run(
                run["id"], run["seal_head"], run["seal_row_count"], run["seal_rows"], rows.get(run["id"], [])
            )
            if finding is not None:
                report.findings.append(finding)
        yield report, batch
