"""Signed, chained digests of the audit (R-GOV-5).

A run's seal (R-GOV-3) catches a row changed behind the triggers, but a
database superuser can rewrite rows and seal them again, or delete a run
with its seal. Digests close that: every ``AUDIT_DIGEST_INTERVAL_SECONDS``
:func:`publish_digests` writes one :class:`~governance.models.AuditDigest`
for the interval ``[start, end)`` that ended ``AUDIT_DIGEST_GRACE_SECONDS``
ago (so every terminal transaction that sealed a run in it has committed):

- its **leaves**, in order: ``["run", run id, seal head, row count,
  status]`` for each run sealed in the interval (``sealed_at``), with the
  seal it had at the interval's end; then ``["reseal", run id, previous
  head, head, governance action id]`` for each re-seal a purge or an
  erasure made in it (``RunReseal``);
- their **Merkle root**: SHA-256 over the leaves (``0x00`` + canonical
  JSON of the leaf) and the nodes (``0x01`` + left + right), an odd node
  carried up as it is; the empty interval's root is SHA-256 of nothing;
- the **header** ``{sequence, interval_start, interval_end, leaf_count,
  root, previous, key_id}``, ``previous`` being the previous digest's
  ``digest`` (empty for the first): intervals follow each other without a
  gap, empty ones included, so a missing digest shows;
- ``digest`` = SHA-256 of the signed message (``yuxi-audit-digest/v1`` and
  a newline, then the header's canonical JSON) and the Ed25519
  ``signature`` of that message, by a private key read from the
  environment or a file (``AUDIT_DIGEST_PRIVATE_KEY[_FILE]``), never from
  the database.

The header, digest and signature are stored in the database and appended
as one JSON line to ``AUDIT_DIGEST_DIR/digests.jsonl``; the leaves stay in
the database, where the signed root authenticates them.
:func:`verify_digests` needs only those files, the database and the
public key: it reports a digest missing, altered or badly signed; a run
removed; a run sealed in a digested interval but not in its digest
(inserted after it, or its seal time rewritten); and a run whose seal no
longer matches the digested one (rewritten and sealed again) unless a
re-seal explains it. Re-seals made since the last digest are reported as
pending: the next digest signs them. A digest proves what the audit held
when it was published, not before.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from django.db import connection, transaction
from django.utils import timezone

from audit.models import AgentRun
from core.config import get_config

from .models import AuditDigest, RunReseal

log = logging.getLogger(__name__)

MESSAGE_TAG = b"yuxi-audit-digest/v1\n"
FILE_NAME = "digests.jsonl"
HEADER_FIELDS = ("sequence", "interval_start", "interval_end", "leaf_count", "root", "previous", "key_id")
# One publisher at a time (pg_advisory_xact_lock key).
_LOCK_KEY = 0x59555849_44494753  # "YUXIDIGS"
# At most this many intervals per call: catching up after downtime goes on
# at the next call.
MAX_INTERVALS_PER_CALL = 500


class DigestKeyError(ValueError):
    """The digest key is missing or not an Ed25519 key (PEM)."""


# -- keys ---------------------------------------------------------------------


def signing_key() -> Ed25519PrivateKey | None:
    """The private key of ``AUDIT_DIGEST_PRIVATE_KEY`` (PEM text) or
    ``AUDIT_DIGEST_PRIVATE_KEY_FILE``; None when neither is set. Raises
    :class:`DigestKeyError` for a key that is not an Ed25519 private key."""
    config = get_config()
    pem = config.AUDIT_DIGEST_PRIVATE_KEY
    if not pem and config.AUDIT_DIGEST_PRIVATE_KEY_FILE:
        try:
            pem = Path(config.AUDIT_DIGEST_PRIVATE_KEY_FILE).read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as exc:
            raise DigestKeyError(f"AUDIT_DIGEST_PRIVATE_KEY_FILE: cannot read it: {exc}") from exc
    if not pem:
        return None
    try:
        key = serialization.load_pem_private_key(pem.encode("ascii"), password=None)
    except (ValueError, TypeError, UnicodeEncodeError) as exc:
        raise DigestKeyError(f"the digest private key is not a PEM private key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise DigestKeyError("the digest private key must be an Ed25519 key")
    return key


def load_public_key(path: str | Path) -> Ed25519PublicKey:
    """The Ed25519 public key in the PEM file ``path``. Raises
    :class:`DigestKeyError`."""
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError) as exc:
        raise DigestKeyError(f"{path}: not a readable PEM public key: {exc}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise DigestKeyError(f"{path}: not an Ed25519 public key")
    return key


def key_id(public: Ed25519PublicKey) -> str:
    """The first 16 hex digits of SHA-256 of the raw public key."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


# -- the tree and the signed message ---------------------------------------------


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def leaf_hash(leaf: list) -> bytes:
    return hashlib.sha256(b"\x00" + _canonical(leaf)).digest()


def merkle_root(leaves: Iterable[list]) -> str:
    """The Merkle root (hex) of ``leaves`` (see the module docstring)."""
    level = [leaf_hash(leaf) for leaf in leaves]
    if not level:
        return hashlib.sha256(b"").hexdigest()
    while len(level) > 1:
        level = [
            hashlib.sha256(b"\x01" + level[i] + level[i + 1]).digest() if i + 1 < len(level) else level[i]
            for i in range(0, len(level), 2)
        ]
    return level[0].hex()


def signed_message(header: dict[str, Any]) -> bytes:
    """What the signature covers: the tag, then the header's canonical JSON."""
    return MESSAGE_TAG + _canonical({name: header[name] for name in HEADER_FIELDS})


def header_of(digest: AuditDigest) -> dict[str, Any]:
    """The signed header of a stored digest, times as ISO 8601 UTC."""
    return {
        "sequence": digest.sequence,
        "interval_start": _iso(digest.interval_start),
        "interval_end": _iso(digest.interval_end),
        "leaf_count": digest.leaf_count,
        "root": digest.root,
        "previous": digest.previous,
        "key_id": digest.key_id,
    }


def file_record(digest: AuditDigest) -> dict[str, Any]:
    """The line of ``digests.jsonl`` for ``digest``."""
    return {**header_of(digest), "digest": digest.digest, "signature": digest.signature}


def _iso(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


# -- leaves -----------------------------------------------------------------------


def interval_leaves(start: dt.datetime, end: dt.datetime) -> list[list]:
    """The leaves of the interval ``[start, end)``: the runs sealed in it
    with the seal they had at ``end`` (a later re-seal's previous head),
    ordered by seal time and id; then the re-seals made in it, in order."""
    runs = list(
        AgentRun.objects.filter(sealed_at__gte=start, sealed_at__lt=end)
        .order_by("sealed_at", "id")
        .values_list("id", "seal_head", "seal_row_count", "status")
    )
    later = {}
    for run_id, previous_head, previous_count in (
        RunReseal.objects.filter(run_id__in=[r[0] for r in runs], created_at__gte=end)
        .order_by("-created_at", "-id")
        .values_list("run_id", "previous_head", "previous_row_count")
    ):
        later[run_id] = (previous_head, previous_count)  # the earliest wins (read last)
    leaves: list[list] = []
    for run_id, head, count, status in runs:
        head, count = later.get(run_id, (head, count))
        leaves.append(["run", str(run_id), head, count, status])
    for run_id, previous_head, head, action_id in (
        RunReseal.objects.filter(created_at__gte=start, created_at__lt=end)
        .order_by("created_at", "id")
        .values_list("run_id", "previous_head", "head", "action_id")
    ):
        leaves.append(["reseal", str(run_id), previous_head, head, action_id])
    return leaves


# -- publishing -------------------------------------------------------------------


def _floor(moment: dt.datetime, seconds: int) -> dt.datetime:
    epoch = int(moment.timestamp())
    return dt.datetime.fromtimestamp(epoch - epoch % seconds, tz=dt.UTC)


def publish_digests(*, now: dt.datetime | None = None) -> list[AuditDigest]:
    """Publish the digest of every interval that ended at least
    ``AUDIT_DIGEST_GRACE_SECONDS`` before ``now`` and has none yet, in
    order (at most :data:`MAX_INTERVALS_PER_CALL`), and append to the
    digest file every stored digest it lacks (a file write that failed
    after its commit). The first interval starts at the interval boundary
    before the first sealed run (or before ``now``). Returns the digests
    made now; ``[]`` without a key. One publisher at a time (an advisory
    lock); raises :class:`DigestKeyError` for a bad key and ``OSError``
    when the folder cannot be written. Implements R-GOV-5."""
    key = signing_key()
    if key is None:
        return []
    config = get_config()
    interval = config.AUDIT_DIGEST_INTERVAL_SECONDS
    now = now or timezone.now()
    due_before = now - dt.timedelta(seconds=config.AUDIT_DIGEST_GRACE_SECONDS)
    public_id = key_id(key.public_key())
    made: list[AuditDigest] = []
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_LOCK_KEY])
        last = AuditDigest.objects.order_by("-sequence").first()
        if last is not None:
            start = last.interval_end
        else:
            first = AgentRun.objects.filter(sealed_at__isnull=False).order_by("sealed_at").values("sealed_at").first()
            start = _floor(first["sealed_at"] if first else now, interval)
        previous, sequence = (last.digest, last.sequence) if last else ("", 0)
        while start + dt.timedelta(seconds=interval) <= due_before and len(made) < MAX_INTERVALS_PER_CALL:
            end = start + dt.timedelta(seconds=interval)
            leaves = interval_leaves(start, end)
            sequence += 1
            header = {
                "sequence": sequence,
                "interval_start": _iso(start),
                "interval_end": _iso(end),
                "leaf_count": len(leaves),
                "root": merkle_root(leaves),
                "previous": previous,
                "key_id": public_id,
            }
            message = signed_message(header)
            digest = AuditDigest.objects.create(
                sequence=sequence,
                interval_start=start,
                interval_end=end,
                leaf_count=len(leaves),
                root=header["root"],
                previous=previous,
                digest=hashlib.sha256(message).hexdigest(),
                signature=base64.b64encode(key.sign(message)).decode("ascii"),
                key_id=public_id,
                leaves=leaves,
            )
            made.append(digest)
            previous, start = digest.digest, end
    append_missing_to_file(Path(config.AUDIT_DIGEST_DIR))
    return made


def append_missing_to_file(directory: Path) -> int:
    """Append to ``directory/digests.jsonl`` every stored digest after the
    file's last sequence; returns how many. Creates the folder."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / FILE_NAME
    last = 0
    if path.exists():
        for record in read_digest_file(path):
            last = max(last, int(record.get("sequence") or 0))
    missing = list(AuditDigest.objects.filter(sequence__gt=last).order_by("sequence"))
    if missing:
        with path.open("a", encoding="utf-8") as handle:
            for digest in missing:
                handle.write(json.dumps(file_record(digest), sort_keys=True) + "\n")
            handle.flush()
    return len(missing)


def read_digest_file(path: Path) -> Iterator[dict[str, Any]]:
    """The records of one digest file; a line that is not a JSON object
    comes as ``{"unreadable": line number}``."""
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            yield record if isinstance(record, dict) else {"unreadable": number}


# -- verification -----------------------------------------------------------------


@dataclass
class DigestReport:
    """What :func:`verify_digests` found: ``problems`` (each a line naming
    the digest or run), ``pending`` (re-seals since the last digest, not
    yet signed), and how much it checked."""

    digests: int = 0
    runs: int = 0
    problems: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_digests(directory: str | Path, public: Ed25519PublicKey) -> DigestReport:
    """Check the audit against the digest files of ``directory`` (every
    ``*.jsonl``, records by sequence), the database and the public key
    ``public`` (see the module docstring for what is reported). Implements
    R-GOV-5."""
    report = DigestReport()
    records = _file_records(Path(directory), report)
    expected_id = key_id(public)
    stored = {d.sequence: d for d in AuditDigest.objects.order_by("sequence")}
    previous = ""
    previous_end = None
    state: dict[str, tuple[str, str]] = {}  # run id -> (head, status) as digested
    for number, record in enumerate(records, start=1):
        sequence = record.get("sequence")
        if sequence != number:
            report.problems.append(f"digest #{number} is missing from the files (found #{sequence} in its place)")
            break
        if not _signed(record, public, expected_id, report):
            break
        if record["previous"] != previous:
            report.problems.append(f"digest #{number} does not chain to digest #{number - 1}")
        if previous_end is not None and record["interval_start"] != previous_end:
            report.problems.append(f"digest #{number} does not start where digest #{number - 1} ended")
        previous, previous_end = record["digest"], record["interval_end"]
        row = stored.get(number)
        if row is None:
            report.problems.append(f"digest #{number} is missing from the database")
            break
        if file_record(row) != {k: record.get(k) for k in file_record(row)}:
            report.problems.append(f"digest #{number} in the database differs from the signed file")
            break
        leaves = row.leaves or []
        if len(leaves) != record["leaf_count"] or merkle_root(leaves) != record["root"]:
            report.problems.append(f"digest #{number}: its leaves in the database do not match its signed root")
            break
        _apply_leaves(number, leaves, state, report)
        report.digests += 1
    for sequence in sorted(set(stored) - set(range(1, len(records) + 1))):
        report.problems.append(f"digest #{sequence} is in the database but not in the files")
    if report.digests:
        first = stored[1].interval_start
        last_end = stored[report.digests].interval_end
        _compare_runs(state, first, last_end, report)
    return report


def _file_records(directory: Path, report: DigestReport) -> list[dict[str, Any]]:
    if not directory.is_dir():
        report.problems.append(f"{directory}: no digest folder")
        return []
    records = []
    for path in sorted(directory.glob("*.jsonl")):
        for record in read_digest_file(path):
            if "unreadable" in record:
                report.problems.append(f"{path.name} line {record['unreadable']}: not a digest record")
            else:
                records.append(record)
    records.sort(key=lambda r: r.get("sequence") if isinstance(r.get("sequence"), int) else 0)
    return records


def _signed(record: dict[str, Any], public: Ed25519PublicKey, expected_id: str, report: DigestReport) -> bool:
    sequence = record.get("sequence")
    try:
        message = signed_message(record)
        signature = base64.b64decode(record["signature"], validate=True)
    except (KeyError, TypeError, ValueError):
        report.problems.append(f"digest #{sequence}: the record is incomplete")
        return False
    if record.get("key_id") != expected_id:
        report.problems.append(f"digest #{sequence} was signed with another key ({record.get('key_id')})")
        return False
    try:
        public.verify(signature, message)
    except InvalidSignature:
        report.problems.append(f"digest #{sequence}: the signature does not match (altered)")
        return False
    if hashlib.sha256(message).hexdigest() != record.get("digest"):
        report.problems.append(f"digest #{sequence}: its digest is not the hash of what was signed")
        return False
    return True


def _apply_leaves(number: int, leaves: list, state: dict, report: DigestReport) -> None:
    """Follow each run's digested seal through one digest's leaves: its
    re-seals first (they happened before the interval's end, which its run
    leaves already show), then its sealed runs."""
    for leaf in leaves:
        if leaf[0] != "reseal":
            continue
        _, run_id, previous_head, head, action_id = leaf
        known = state.get(run_id)
        if known is not None and known[0] != previous_head:
            report.problems.append(
                f"run {run_id}: re-sealed by action #{action_id} from a seal that is not the digested one "
                f"(digest #{number})"
            )
        state[run_id] = (head, known[1] if known else "")
    for leaf in leaves:
        if leaf[0] != "run":
            continue
        _, run_id, head, _count, status = leaf
        known = state.get(run_id)
        if known is not None and known[0] != head and known[1] and known[1] != AgentRun.Status.INTERRUPTED:
            report.problems.append(f"run {run_id}: sealed again in digest #{number} without a re-seal")
        state[run_id] = (head, status)


def _compare_runs(state: dict, first: dt.datetime, last_end: dt.datetime, report: DigestReport) -> None:
    """The database's runs against what the digests signed."""
    current = {
        str(run_id): (head, sealed_at)
        for run_id, head, sealed_at in AgentRun.objects.filter(sealed_at__isnull=False).values_list(
            "id", "seal_head", "sealed_at"
        )
    }
    report.runs = len(state)
    for run_id, (head, _status) in state.items():
        if run_id not in current:
            report.problems.append(f"run {run_id}: in the digests, removed from the database")
            continue
        now_head = current[run_id][0]
        if now_head == head:
            continue
        chain = list(
            RunReseal.objects.filter(run_id=run_id, created_at__gte=last_end)
            .order_by("created_at", "id")
            .values_list("previous_head", "head", "action_id")
        )
        walked = head
        for previous_head, next_head, _action in chain:
            if previous_head == walked:
                walked = next_head
        if chain and walked == now_head:
            report.pending.append(
                f"run {run_id}: re-sealed since the last digest by action #{chain[-1][2]} (the next digest signs it)"
            )
        else:
            report.problems.append(f"run {run_id}: its seal differs from the digested one (rewritten and re-sealed)")
    for run_id, (_head, sealed_at) in current.items():
        if first <= sealed_at < last_end and run_id not in state:
            report.problems.append(f"run {run_id}: sealed at {_iso(sealed_at)}, not in that interval's digest")
