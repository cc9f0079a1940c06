"""The check of the signed digests (R-GOV-5), stand-alone.

This module is the one implementation of what ``verify_audit --digests``
checks (see ``governance.digests`` for what a digest holds). It imports only
the standard library and ``cryptography`` and works on plain data, so that
an auditor can run it without the product installed: copy this one file and
run, with Python >= 3.10, ``cryptography`` and ``psycopg``::

    python digest_check.py --database postgres://USER@HOST:5432/NAME \\
        --digests DIR --public-key digest-key.pub.pem

It prints the same lines as ``verify_audit --digests`` and exits 0 when the
audit matches its digests, 1 when it does not, 2 on bad input (a key that
cannot be read, a database that cannot be reached). Inside the product,
``governance.digests.verify_digests`` reads the same data with the ORM and
calls :func:`check_digests`.

The data, as both callers pass it:

- digest records: the JSON objects of ``DIR/*.jsonl``;
- stored digests: one dict per ``governance_auditdigest`` row with the keys
  of :data:`ROW_FIELDS` (times as aware datetimes, ``leaves`` as a list);
- runs: ``(run id, seal head, sealed_at)`` for every sealed run, streamed;
- re-seals: ``(run id, previous head, head, action id, created_at)``, in
  the order they were made.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import hashlib
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

MESSAGE_TAG = b"yuxi-audit-digest/v1\n"
FILE_NAME = "digests.jsonl"
HEADER_FIELDS = ("sequence", "interval_start", "interval_end", "leaf_count", "root", "previous", "key_id")
# The columns of governance_auditdigest a check reads.
ROW_FIELDS = (*HEADER_FIELDS, "digest", "signature", "leaves")
# AgentRun.Status.INTERRUPTED: an interrupted run is sealed again when it is
# resumed, without a re-seal (tests/governance/test_digests.py holds the two equal).
INTERRUPTED = "interrupted"
# dt.UTC is Python 3.11+; the stand-alone check runs on 3.10.
_UTC = dt.timezone.utc  # noqa: UP017

# The last line of a check that found nothing.
# What it proves: not that each run's rows still match its seal (verify_audit
# recomputes the seals), but that every digested run is there with its seal.
INTACT = "the digests are intact and every digested run is there with its signed seal"

Run = tuple[str, str, dt.datetime]
Reseal = tuple[str, str, str, int, dt.datetime]


class DigestKeyError(ValueError):
    """The digest key is missing or not an Ed25519 key (PEM)."""


# -- keys ---------------------------------------------------------------------


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


def canonical(value: Any) -> bytes:
    """The canonical JSON of ``value`` (sorted keys, no spaces, UTF-8)."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def leaf_hash(leaf: list) -> bytes:
    return hashlib.sha256(b"\x00" + canonical(leaf)).digest()


def merkle_root(leaves: Iterable[list]) -> str:
    """The Merkle root (hex) of ``leaves``: SHA-256 over the leaves (``0x00``
    + canonical JSON) and the nodes (``0x01`` + left + right), an odd node
    carried up as it is; SHA-256 of nothing for no leaves."""
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
    return MESSAGE_TAG + canonical({name: header[name] for name in HEADER_FIELDS})


def iso(moment: dt.datetime) -> str:
    """``moment`` (aware) as ISO 8601 UTC with a ``Z``."""
    return moment.astimezone(_UTC).isoformat().replace("+00:00", "Z")


def header_of(row: dict[str, Any]) -> dict[str, Any]:
    """The signed header of a stored digest row, times as ISO 8601 UTC."""
    return {
        **{name: row[name] for name in HEADER_FIELDS},
        "interval_start": iso(row["interval_start"]),
        "interval_end": iso(row["interval_end"]),
    }


def file_record(row: dict[str, Any]) -> dict[str, Any]:
    """The line of ``digests.jsonl`` for a stored digest row."""
    return {**header_of(row), "digest": row["digest"], "signature": row["signature"]}


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


# -- the check --------------------------------------------------------------------


@dataclass
class DigestReport:
    """What :func:`check_digests` found: ``problems`` (each a line naming
    the digest or run), ``pending`` (re-seals since the last digest, not
    yet signed), and how much it checked."""

    digests: int = 0
    runs: int = 0
    problems: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def summary(self) -> str:
        """The closing line: how much was checked."""
        return f"{self.digests} signed digest(s) checked, covering {self.runs} run(s)"


def check_digests(
    directory: str | Path,
    public: Ed25519PublicKey,
    *,
    stored: Iterable[dict[str, Any]],
    runs: Iterable[Run],
    reseals_since: Callable[[dt.datetime], Iterable[Reseal]],
) -> DigestReport:
    """Check the audit against the digest files of ``directory`` (every
    ``*.jsonl``, records by sequence) and the public key ``public``.

    ``stored`` are the digest rows of the database (dicts of
    :data:`ROW_FIELDS`); ``runs`` every sealed run as ``(id, seal head,
    sealed_at)``, read once and only when a digest verified (stream it);
    ``reseals_since(moment)`` the re-seals made at or after ``moment``, in
    order, read only when a run's seal differs from its digested one.

    Reports a digest missing, altered or badly signed; a run removed; a run
    sealed in a digested interval but not in its digest; a run whose seal
    no longer matches the digested one unless a re-seal explains it (then
    pending, when made since the last digest). Implements R-GOV-5."""
    report = DigestReport()
    records = _file_records(Path(directory), report)
    expected_id = key_id(public)
    rows = {row["sequence"]: row for row in stored}
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
        row = rows.get(number)
        if row is None:
            report.problems.append(f"digest #{number} is missing from the database")
            break
        expected = file_record(row)
        if expected != {k: record.get(k) for k in expected}:
            report.problems.append(f"digest #{number} in the database differs from the signed file")
            break
        leaves = row["leaves"] or []
        if len(leaves) != record["leaf_count"] or merkle_root(leaves) != record["root"]:
            report.problems.append(f"digest #{number}: its leaves in the database do not match its signed root")
            break
        _apply_leaves(number, leaves, state, report)
        report.digests += 1
    in_files = {r.get("sequence") for r in records}
    if rows and not records and Path(directory).is_dir():
        report.problems.append(
            f"{directory}: no digest records, where the database holds {len(rows)} digest(s) "
            "(the files were removed, or this is not AUDIT_DIGEST_DIR)"
        )
    else:
        for sequence in sorted(set(rows) - in_files):
            report.problems.append(f"digest #{sequence} is in the database but not in the files")
    if report.digests:
        first = rows[1]["interval_start"]
        last_end = rows[report.digests]["interval_end"]
        _compare_runs(state, first, last_end, runs, reseals_since, report)
    return report


def _file_records(directory: Path, report: DigestReport) -> list[dict[str, Any]]:
    if not directory.is_dir():
        report.problems.append(f"{directory}: no digest folder")
        return []
    # A digest may be in several files (a copy kept beside the file, a line
    # appended twice): the same record counts once, two different records
    # of one sequence are a problem.
    by_sequence: dict[Any, dict[str, Any]] = {}
    for path in sorted(directory.glob("*.jsonl")):
        for record in read_digest_file(path):
            if "unreadable" in record:
                report.problems.append(f"{path.name} line {record['unreadable']}: not a digest record")
                continue
            sequence = record.get("sequence")
            seen = by_sequence.setdefault(sequence, record)
            if seen != record:
                report.problems.append(f"{path.name}: two different records of digest #{sequence}")
    return sorted(by_sequence.values(), key=lambda r: r.get("sequence") if isinstance(r.get("sequence"), int) else 0)


def _signed(record: dict[str, Any], public: Ed25519PublicKey, expected_id: str, report: DigestReport) -> bool:
    sequence = record.get("sequence")
    try:
        message = signed_message(record)
        signature = base64.b64decode(record["signature"], validate=True)
    except (KeyError, TypeError, ValueError):
        report.problems.append(f"digest #{sequence}: the record is incomplete")
        return False
    if record.get("key_id") != expected_id:
        report.problems.append(
            f"digest #{sequence} was signed with key {record.get('key_id')}, not with the public key given "
            f"({expected_id}): check --public-key"
        )
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
        if known is not None and known[0] != head and known[1] and known[1] != INTERRUPTED:
            report.problems.append(f"run {run_id}: sealed again in digest #{number} without a re-seal")
        state[run_id] = (head, status)


def _compare_runs(
    state: dict[str, tuple[str, str]],
    first: dt.datetime,
    last_end: dt.datetime,
    runs: Iterable[Run],
    reseals_since: Callable[[dt.datetime], Iterable[Reseal]],
    report: DigestReport,
) -> None:
    """The database's runs against what the digests signed. ``runs`` is
    read once; only the current heads of digested runs are kept."""
    report.runs = len(state)
    heads: dict[str, str] = {}  # digested run id -> its seal head now
    unknown: list[str] = []
    for run_id, head, sealed_at in runs:
        run_id = str(run_id)
        if run_id in state:
            heads[run_id] = head
        elif first <= sealed_at < last_end:
            unknown.append(f"run {run_id}: sealed at {iso(sealed_at)}, not in that interval's digest")
    chains: dict[str, list[tuple[str, str, int]]] | None = None
    for run_id, (head, _status) in state.items():
        if run_id not in heads:
            report.problems.append(f"run {run_id}: in the digests, removed from the database")
            continue
        now_head = heads[run_id]
        if now_head == head:
            continue
        if chains is None:
            chains = {}
            for reseal_run, previous_head, next_head, action_id, created_at in reseals_since(last_end):
                if created_at >= last_end:
                    chains.setdefault(str(reseal_run), []).append((previous_head, next_head, action_id))
        chain = chains.get(run_id, [])
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
    report.problems.extend(unknown)


# -- stand-alone ------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python digest_check.py --database URL --digests DIR --public-key
    FILE``: read the digest rows, the sealed runs (a server-side cursor)
    and the re-seals with ``psycopg`` in one read-only snapshot, check them
    and print the report. Returns 0 (intact), 1 (problems) or 2 (bad input)."""
    parser = argparse.ArgumentParser(description="Check the audit against its signed digests (R-GOV-5).")
    parser.add_argument("--database", required=True, help="postgres://user[:password]@host:port/name")
    parser.add_argument("--digests", required=True, help="the folder of the digest files (*.jsonl)")
    parser.add_argument("--public-key", required=True, help="the Ed25519 public key (PEM) the digests were signed with")
    args = parser.parse_args(argv)
    try:
        public = load_public_key(args.public_key)
    except DigestKeyError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not Path(args.digests).is_dir():
        print(f"--digests: {args.digests} is not a folder", file=sys.stderr)
        return 2
    import psycopg  # only the stand-alone check needs it

    try:
        connection = psycopg.connect(args.database)
    except psycopg.Error as exc:
        print(f"cannot reach the database: {exc}", file=sys.stderr)
        return 2
    with connection:
        # One snapshot for all three tables, so a run sealed meanwhile does not
        # look like one slipped into a digested interval.
        connection.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        connection.read_only = True
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT {', '.join(ROW_FIELDS)} FROM governance_auditdigest ORDER BY sequence")
            stored = [dict(zip(ROW_FIELDS, row, strict=True)) for row in cursor]

        def runs() -> Iterator[Run]:
            with connection.cursor(name="digest_check_runs") as cursor:
                cursor.itersize = 5000
                cursor.execute("SELECT id, seal_head, sealed_at FROM audit_agentrun WHERE sealed_at IS NOT NULL")
                yield from cursor

        def reseals_since(moment: dt.datetime) -> list[Reseal]:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT run_id, previous_head, head, action_id, created_at FROM governance_runreseal "
                    "WHERE created_at >= %s ORDER BY created_at, id",
                    [moment],
                )
                return cursor.fetchall()

        report = check_digests(args.digests, public, stored=stored, runs=runs(), reseals_since=reseals_since)
    for line in (*report.problems, *report.pending, report.summary):
        print(line)
    if report.ok:
        print(INTACT)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
