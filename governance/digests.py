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
  environment or a file (``AUDIT_SIGNING_KEY[_FILE]``), never from
  the database.

The header, digest and signature are stored in the database and appended
as one JSON line to ``AUDIT_DIGEST_DIR/digests.jsonl``; the leaves stay in
the database, where the signed root authenticates them.
:func:`verify_digests` needs only those files, the database and the
public key (the check itself is ``governance.digest_check``, which also runs
stand-alone, without the product): it reports a digest missing, altered or badly signed; a run
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
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from django.db import connection, transaction
from django.utils import timezone

from audit.models import AgentRun
from core.config import get_config

from . import digest_check
from .digest_check import (
    FILE_NAME,
    ROW_FIELDS,
    DigestKeyError,
    DigestReport,
    check_digests,
    iso,
    key_id,
    merkle_root,
    read_digest_file,
    signed_message,
)

# verify_audit's, from here.
from .digest_check import INTACT as INTACT
from .digest_check import load_public_key as load_public_key
from .models import AuditDigest, RunReseal

log = logging.getLogger(__name__)

# One publisher at a time (pg_advisory_xact_lock key).
_LOCK_KEY = 0x59555849_44494753  # "YUXIDIGS"
# At most this many intervals per call: catching up after downtime goes on
# at the next call.
MAX_INTERVALS_PER_CALL = 500


# -- keys ---------------------------------------------------------------------


def signing_key() -> Ed25519PrivateKey | None:
    """The private key of ``AUDIT_SIGNING_KEY`` (PEM text) or
    ``AUDIT_SIGNING_KEY_FILE``; None when neither is set. Raises
    :class:`DigestKeyError` for a key that is not an Ed25519 private key."""
    config = get_config()
    pem = config.AUDIT_SIGNING_KEY
    if not pem and config.AUDIT_SIGNING_KEY_FILE:
        try:
            pem = Path(config.AUDIT_SIGNING_KEY_FILE).read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as exc:
            raise DigestKeyError(f"AUDIT_SIGNING_KEY_FILE: cannot read it: {exc}") from exc
    if not pem:
        return None
    try:
        key = serialization.load_pem_private_key(pem.encode("ascii"), password=None)
    except (ValueError, TypeError, UnicodeEncodeError) as exc:
        raise DigestKeyError(f"the digest private key is not a PEM private key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise DigestKeyError("the digest private key must be an Ed25519 key")
    return key


# -- the file record -------------------------------------------------------------


def file_record(digest: AuditDigest) -> dict[str, Any]:
    """The line of ``digests.jsonl`` for ``digest``."""
    return digest_check.file_record(_row(digest))


def _row(digest: AuditDigest) -> dict[str, Any]:
    return {name: getattr(digest, name) for name in ROW_FIELDS}


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
                "interval_start": iso(start),
                "interval_end": iso(end),
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


# -- verification -----------------------------------------------------------------


def verify_digests(directory: str | Path, public: Ed25519PublicKey) -> DigestReport:
    """Check the audit against the digest files of ``directory`` (every
    ``*.jsonl``, records by sequence), the database and the public key
    ``public``: reads the digest rows, the sealed runs (streamed) and the
    re-seals with the ORM and hands them to
    :func:`governance.digest_check.check_digests`, which says what is
    reported. Implements R-GOV-5."""
    return check_digests(
        directory,
        public,
        stored=AuditDigest.objects.order_by("sequence").values(*ROW_FIELDS),
        runs=AgentRun.objects.filter(sealed_at__isnull=False)
        .values_list("id", "seal_head", "sealed_at")
        .iterator(chunk_size=5000),
        reseals_since=lambda moment: (
            RunReseal.objects.filter(created_at__gte=moment)
            .order_by("created_at", "id")
            .values_list("run_id", "previous_head", "head", "action_id", "created_at")
        ),
    )
