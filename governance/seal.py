"""Sealed runs (R-GOV-3, R-GOV-4): a hash chain over a run's closed audit rows.

The terminal transaction calls :func:`seal_run` once every row of the run is
closed. Each audit row (``operation_id`` set, the run's final answer
included) is encoded canonically — every fact field of :data:`FACT_FIELDS`:
ids, role, type, status, sequence, timestamps, duration, usage and its
cause, cost and price, content, declared tool calls, tool name and input,
the declaring row, the subagent namespace and parent, the effect key, the
row a replayed result came from and the attempt, and the metadata that
carries the raw tool output and the purge and erasure marks — and hashed
(``row digest``). The chain starts from ``SHA-256("yuxi-seal/v<version>" |
run id)``; each link is ``SHA-256(previous link | row digest)`` over the
rows in timeline order (``sequence``, rows without one last, then id). The
run keeps the head, the row count, the seal version, when it was sealed and
``seal_rows`` — ``[[row id, first 16 hex digits of the row digest], …]`` —
so that a verification names every row that differs, not only the run.

Version 4 seals the run as well as its rows: the run's own facts
(:data:`RUN_FACT_FIELDS`: who asked, in which thread and turn, what they
asked — the input —, the agent and model, the status, attempt, start and
end, usage, error, pending approval, answer and replay mark) are hashed into the chain's first link, and the
run's user message (the prompt, a row without an operation id) is a row of
the chain like its audit rows. ``seal_rows`` then starts with
``["run", first 16 hex digits of the run digest]``, so a verification says
whether the run itself or which row changed.

Versions: a run sealed before the version was stored (``seal_version``
null) was sealed under version 1, whose encoding lacks the namespace and
the parent (:data:`V1_FACT_FIELDS`); version 2 (:data:`V2_FACT_FIELDS`)
lacks the effect ledger's facts — effect key, replayed-from row, attempt
(R-EFF-1); version 3 lacks the run's own facts and its user message. A
run is verified under the version it was sealed under for
ever, and a purge or erasure that seals it again seals it under the current
:data:`SEAL_VERSION`. The version is part of the chain's first link, so a
seal cannot be passed off as another version's.

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
from django.db.models import Q
from django.utils import timezone

# The version new seals are made under (stored on the run as ``seal_version``).
SEAL_VERSION = 4
ROW_DIGEST_CHARS = 16

# Version 1 sealed these, and never changes: seals made under it verify for
# ever. Each later version seals its predecessor's facts and those it adds;
# the encoding sorts the keys, so the order here does not matter.
V1_FACT_FIELDS = (
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
# Version 2 added the subagent namespace and parent (R-SUB-1, R-GOV-4).
V2_FACT_FIELDS = (*V1_FACT_FIELDS, "namespace", "parent_operation_id")
# Version 3 added the effect ledger's facts (R-EFF-1, R-RUN-15).
V3_FACT_FIELDS = (*V2_FACT_FIELDS, "effect_key", "replayed_from_id", "attempt")

# The facts a seal covers, read the same way by the seal and the check:
# every field of a message row but the bookkeeping ``created_at`` and
# ``updated_at`` (R-GOV-4). Version 4 seals the same fields of each row.
FACT_FIELDS = V3_FACT_FIELDS

# Version 4 also sealed the run's own facts: what was asked and by whom, and
# how the run ended — those the sealed-run trigger holds append-only
# (governance.triggers). Not its lease, dispatch, rollup, export or seal
# bookkeeping (RUN_BOOKKEEPING_FIELDS).
RUN_FACT_FIELDS = (
    "id",
    "thread_id",
    "user_id",
    "turn_id",
    "resumed_from_id",
    "request_id",
    "agent_id",
    "model",
    "input",
    "status",
    "attempt",
    "started_at",
    "finished_at",
    "usage",
    "error_type",
    "error_message",
    "interrupts",
    "output_message_id",
    "replay_of",
)
RUN_BOOKKEEPING_FIELDS = (
    "request_fingerprint",  # derived from the input
    "lease_owner",
    "fencing_token",
    "lease_expires_at",
    "trace_id",
    "created_at",
    "cancel_requested_at",
    "updated_at",
    "rolled_up_at",
    "dispatched_at",
    "seal_head",
    "seal_row_count",
    "seal_rows",
    "seal_version",
    "sealed_at",
    "webhook",  # where its end is announced (R-API-3)
)
# The first entry of a version 4 ``seal_rows``: the run's own digest.
RUN_ENTRY = "run"

# Facts added to version 1 after rows were first sealed under it: hashed only
# when set, so that a row sealed before the field existed (null there) keeps
# its digest, while setting, changing or clearing one still changes it.
# Versions 2 and 3 hash every fact of theirs, set or not.
V1_LATER_FACT_FIELDS = frozenset({"usage_cause"})  # R-MA-12

_CHAIN_TAGS = {1: b"yuxi-seal/v1", 2: b"yuxi-seal/v2", 3: b"yuxi-seal/v3", 4: b"yuxi-seal/v4"}


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.astimezone(timezone.UTC).isoformat(timespec="microseconds")
    if isinstance(value, Decimal | uuid.UUID):
        return str(value)
    return value


def _encoded(facts: dict[str, Any], version: int) -> dict[str, Any]:
    if version == 1:
        return {
            name: _plain(facts[name])
            for name in V1_FACT_FIELDS
            if facts[name] is not None or name not in V1_LATER_FACT_FIELDS
        }
    if version == 2:
        return {name: _plain(facts[name]) for name in V2_FACT_FIELDS}
    if version in (3, 4):
        return {name: _plain(facts[name]) for name in FACT_FIELDS}
    raise ValueError(f"unknown seal version {version!r}")


def _sha256_of(encoded: dict[str, Any]) -> str:
    text = json.dumps(encoded, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def row_digest(facts: dict[str, Any], *, version: int = SEAL_VERSION) -> str:
    """SHA-256 (hex) of one row's canonical encoding under seal ``version``
    (1 to 4; ``facts`` holds at least that version's fields): JSON with
    sorted keys, no spaces and ASCII escapes (a lone surrogate hashes too,
    R-RUN-11). Raises ``ValueError`` for an unknown version (R-GOV-3,
    R-GOV-4)."""
    return _sha256_of(_encoded(facts, version))


def run_digest(facts: dict[str, Any]) -> str:
    """SHA-256 (hex) of a run's own facts (:data:`RUN_FACT_FIELDS`, as
    :func:`run_facts` reads them), encoded as :func:`row_digest` encodes a
    row: what seal version 4 hashes into its chain's first link (R-GOV-3)."""
    return _sha256_of({name: _plain(facts[name]) for name in RUN_FACT_FIELDS})


def run_facts(run) -> dict[str, Any]:
    """The facts :func:`run_digest` hashes, of an ``AgentRun`` instance."""
    return {name: getattr(run, name) for name in RUN_FACT_FIELDS}


def is_sealed_row(facts: dict[str, Any], version: int) -> bool:
    """Whether a row of the run (:func:`audit_row_facts`) is in a seal of
    ``version``: an audit row always; the user's message from version 4."""
    return facts["operation_id"] is not None or version >= 4


def _timeline_key(facts: dict[str, Any]) -> tuple:
    # The user's message (no operation id) first; audit rows by sequence.
    return (facts["operation_id"] is not None, facts["sequence"] is None, facts["sequence"] or 0, facts["id"])


@dataclass
class Seal:
    head: str
    row_count: int
    rows: list[list[Any]] = field(default_factory=list)
    version: int = SEAL_VERSION


def chain(run_id, digests: Iterable[tuple[int, str]], *, version: int = SEAL_VERSION, run: str | None = None) -> Seal:
    """The seal of ``run_id`` under ``version`` over ``(row id, row digest)``
    in timeline order; from version 4 ``run`` is the run's own digest
    (:func:`run_digest`), hashed into the first link. Raises ``ValueError``
    for an unknown version, or a version 4 chain without ``run``."""
    if version not in _CHAIN_TAGS:
        raise ValueError(f"unknown seal version {version!r}")
    start = _CHAIN_TAGS[version] + b"|" + str(run_id).encode()
    entries = []
    if version >= 4:
        if run is None:
            raise ValueError("a version 4 seal covers the run's own facts: give its run digest")
        start += b"|" + bytes.fromhex(run)
        entries.append([RUN_ENTRY, run[:ROW_DIGEST_CHARS]])
    link = hashlib.sha256(start).digest()
    row_count = 0
    for row_id, digest in digests:
        link = hashlib.sha256(link + bytes.fromhex(digest)).digest()
        entries.append([row_id, digest[:ROW_DIGEST_CHARS]])
        row_count += 1
    return Seal(head=link.hex(), row_count=row_count, rows=entries, version=version)


def audit_row_facts(run_ids: list) -> dict[Any, list[dict[str, Any]]]:
    """``{run id: [facts of each row a seal may cover, in timeline order]}``,
    one query: the run's audit rows and its user message (only version 4
    seals the latter, :func:`is_sealed_row`)."""
    from conversations.models import Message

    by_run: dict[Any, list[dict[str, Any]]] = {run_id: [] for run_id in run_ids}
    own = Message.objects.filter(run_id__in=run_ids).filter(Q(operation_id__isnull=False) | Q(role=Message.Role.USER))
    for facts in own.values(*FACT_FIELDS):
        by_run.setdefault(facts["run_id"], []).append(facts)
    for rows in by_run.values():
        rows.sort(key=_timeline_key)
    return by_run


def compute_seal(
    run_id, rows: list[dict[str, Any]], *, version: int = SEAL_VERSION, run: dict[str, Any] | None = None
) -> Seal:
    """The seal of ``run_id`` under ``version`` over ``rows`` (facts in
    timeline order, as :func:`audit_row_facts` gives them; rows the version
    does not seal are left out) and, from version 4, ``run``, the run's own
    facts (:func:`run_facts`). Raises ``ValueError`` as :func:`chain`."""
    digests = ((facts["id"], row_digest(facts, version=version)) for facts in rows if is_sealed_row(facts, version))
    run_hash = run_digest(run) if version >= 4 and run is not None else None
    return chain(run_id, digests, version=version, run=run_hash)


def recompute_seal(run_id, *, version: int = SEAL_VERSION) -> Seal:
    """The seal of the stored run ``run_id`` under ``version``, from its
    rows and its own facts as they are now (two queries). Raises
    ``AgentRun.DoesNotExist`` for an unknown run."""
    from audit.models import AgentRun

    run = AgentRun.objects.values(*RUN_FACT_FIELDS).get(pk=run_id)
    return compute_seal(run_id, audit_row_facts([run_id])[run_id], version=version, run=run)


def seal_run(run, *, save: bool = False, rows: list[dict[str, Any]] | None = None) -> Seal:
    """Seal a terminal run under :data:`SEAL_VERSION`: hash its audit rows
    and set ``seal_head``, ``seal_row_count``, ``seal_rows``,
    ``seal_version`` and ``sealed_at`` on ``run``.

    The terminal transaction calls it with every row closed, the run row
    locked and its terminal fields set, right before it saves the run: the
    seal is written by that same save (one UPDATE of the run, whose status
    and seal change together). A purge or erasure passes the facts of the
    rows as it left them (read again in one query for its whole batch) and
    saves its batch's seals together, under the audited bypass; with
    ``save=True`` the seal fields alone of this run are updated. One
    SELECT of the run's rows, unless ``rows`` gives their facts (each with
    :data:`FACT_FIELDS` as :func:`audit_row_facts` reads them, the user's
    message included, in any order: the terminal transaction has just read
    and written them). The run's own facts are read from ``run``, as it
    will be saved. Implements R-GOV-3 and R-GOV-4.
    """
    from audit.models import AgentRun

    rows = audit_row_facts([run.pk])[run.pk] if rows is None else sorted(rows, key=_timeline_key)
    seal = compute_seal(run.pk, rows, run=run_facts(run))
    run.seal_head, run.seal_row_count, run.seal_rows = seal.head, seal.row_count, seal.rows
    run.seal_version = seal.version
    run.sealed_at = timezone.now()
    if save:
        AgentRun.objects.filter(pk=run.pk).update(
            seal_head=run.seal_head,
            seal_row_count=run.seal_row_count,
            seal_rows=run.seal_rows,
            seal_version=run.seal_version,
            sealed_at=run.sealed_at,
        )
    return seal


# --------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """One row of a run that differs from the run's seal: ``kind`` is
    ``changed``, ``removed``, ``added``, ``moved`` (in sequence: its order
    against another row of the run is not the sealed one; ``row`` says too
    whether its facts changed), ``run`` (the run's own facts, a version 4
    seal: its input, status, end…; ``row_id`` is None) or ``seal`` (the
    rows match ``seal_rows`` but the head does not: the seal itself was
    edited; ``row_id`` is None)."""

    run_id: uuid.UUID
    kind: str
    row_id: int | None
    row: str

    def __str__(self) -> str:
        if self.kind == "seal":
            return f"run {self.run_id}: the stored seal was changed ({self.row})"
        if self.kind == "run":
            return f"run {self.run_id}: the run's own facts changed after sealing ({self.row})"
        if self.kind == "moved":
            return f"run {self.run_id}: row {self.row_id} moved in sequence after sealing ({self.row})"
        return f"run {self.run_id}: row {self.row_id} {self.kind} after sealing ({self.row})"


def _describe(facts: dict[str, Any]) -> str:
    if facts["operation_id"] is None:
        return f"the {facts['role']}'s message"
    return f"{facts['role']} {facts['operation_id']}, sequence {facts['sequence']}"


_RUN_FACTS_NAMED = (
    "one of its input, status, attempt, start, end, usage, error, pending approval, answer, replay mark, "
    "thread, user, turn, request id, agent, model"
)


def _out_of_order(ranks: list[int]) -> set[int]:
    """Indexes of ``ranks`` (sealed positions, in today's order) that are
    in an inversion with another entry: a row after one sealed later than
    it, or before one sealed earlier. A swap names both rows."""
    late, early = set(), set()
    highest = -1
    for index, rank in enumerate(ranks):
        if rank < highest:
            late.add(index)
        highest = max(highest, rank)
    lowest = len(ranks)
    for index in range(len(ranks) - 1, -1, -1):
        if ranks[index] > lowest:
            early.add(index)
        lowest = min(lowest, ranks[index])
    return late | early


def check_run(
    run_id,
    head: str,
    row_count: int,
    sealed_rows: list,
    rows: list[dict[str, Any]],
    *,
    version: int | None,
    run: dict[str, Any] | None = None,
) -> list[Finding]:
    """Compare a run's rows with its seal; an empty list when they match.

    ``sealed_rows`` is the run's ``seal_rows`` (``[[row id, digest
    prefix], …]``), ``rows`` the facts of its rows in timeline order
    (:func:`audit_row_facts`), ``version`` its ``seal_version`` (None: sealed
    before versions were stored, version 1), ``run`` its own facts
    (:data:`RUN_FACT_FIELDS`; needed from version 4). Otherwise one
    :class:`Finding` per difference — the run's own facts, then every row
    added, removed, changed or moved in sequence, in today's timeline order,
    the removed ones last — or a single ``seal`` finding when everything
    matches ``seal_rows`` (R-GOV-3, R-GOV-4). Raises ``ValueError`` for an
    unknown version, or a version 4 seal checked without ``run``."""
    version = version or 1
    rows = [facts for facts in rows if is_sealed_row(facts, version)]
    digests = [(facts["id"], row_digest(facts, version=version)) for facts in rows]
    if version >= 4 and run is None:
        raise ValueError("a version 4 seal covers the run's own facts: give them")
    run_hash = run_digest(run) if version >= 4 else None
    seal = chain(run_id, digests, version=version, run=run_hash)
    if seal.head == head and seal.row_count == row_count:
        return []
    by_id = {facts["id"]: facts for facts in rows}
    entries = list(sealed_rows or [])
    findings = []
    if version >= 4:
        sealed_run = entries.pop(0)[1] if entries and entries[0][0] == RUN_ENTRY else None
        if sealed_run != run_hash[:ROW_DIGEST_CHARS]:
            findings.append(Finding(run_id, "run", None, _RUN_FACTS_NAMED))
    sealed = {entry[0]: (position, entry[1]) for position, entry in enumerate(entries)}
    kept = [(row_id, digest) for row_id, digest in digests if row_id in sealed]
    out_of_order = {kept[index][0] for index in _out_of_order([sealed[row_id][0] for row_id, _ in kept])}
    for position, (row_id, digest) in enumerate(digests):
        row = _describe(by_id[row_id])
        if row_id not in sealed:
            findings.append(Finding(run_id, "added", row_id, row))
            continue
        sealed_position, sealed_digest = sealed[row_id]
        changed = sealed_digest != digest[:ROW_DIGEST_CHARS]
        if row_id in out_of_order:
            row += f"; row {sealed_position + 1} of the seal, now row {position + 1}"
            findings.append(Finding(run_id, "moved", row_id, row + ("; its facts changed too" if changed else "")))
        elif changed:
            findings.append(Finding(run_id, "changed", row_id, row))
    findings.extend(
        Finding(run_id, "removed", row_id, "row no longer exists") for row_id in sealed if row_id not in by_id
    )
    if not findings:
        findings.append(Finding(run_id, "seal", None, f"head {head[:16]}…, rows recompute to {seal.head[:16]}…"))
    return findings


@dataclass
class Report:
    """What :func:`verify_runs` found so far: runs checked, sealed and
    unsealed, the runs that differ from their seal (``changed``) and one
    :class:`Finding` per differing row."""

    checked: int = 0
    sealed: int = 0
    unsealed: int = 0
    changed: int = 0
    findings: list[Finding] = field(default_factory=list)


def verify_runs(runs, *, batch_size: int = 200) -> Iterator[tuple[Report, list]]:
    """Recompute the seals of ``runs`` (an ``AgentRun`` QuerySet of terminal
    runs) in batches of ``batch_size`` runs, keyset-paged by id, one query
    for the runs and one for their rows per batch. Yields ``(report so far,
    the batch's runs)`` after each batch. Runs without a seal (ended before
    sealing existed) are counted as unsealed, not as broken; each sealed
    run is checked under its own seal version, and every row that differs
    is reported (R-GOV-3, R-GOV-4)."""
    report = Report()
    last = None
    fields = (*RUN_FACT_FIELDS, "seal_head", "seal_row_count", "seal_rows", "seal_version", "sealed_at")
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
            findings = check_run(
                run["id"],
                run["seal_head"],
                run["seal_row_count"],
                run["seal_rows"],
                rows.get(run["id"], []),
                version=run["seal_version"],
                run=run,
            )
            report.changed += bool(findings)
            report.findings.extend(findings)
        yield report, batch
