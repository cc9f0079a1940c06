"""Signed, chained digests (R-GOV-5): what a database superuser does
behind the application's back — rows rewritten and the run sealed again,
a run removed, a run slipped into an interval already digested, a digest
altered or removed in the database or in the files — is reported by
``verify_audit --digests DIR --public-key FILE``, which trusts only the
files, the database and the public key. A purge's re-seal is signed by the
next digest and still verifies.

Each attack is made as the PostgreSQL superuser with the triggers off
(``behind_the_back``). Intervals are one second long here, so that real
time closes them."""

from __future__ import annotations

import datetime as dt
import io
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from audit.models import AgentRun
from conversations.models import Message
from core.config import BASE_DIR, get_config
from governance import digest_check
from governance.digest_check import INTERRUPTED, key_id
from governance.digests import FILE_NAME, load_public_key, merkle_root, publish_digests, verify_digests
from governance.models import AuditDigest
from governance.seal import seal_run
from governance.services import payloads_purge, user_erase
from tests.e2e.stack import database_url_of
from tests.read.builders import tool_turn

from .helpers import behind_the_back, verify

pytestmark = pytest.mark.django_db


def _pem(key: Ed25519PrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


def _public_pem(key: Ed25519PrivateKey, path) -> str:
    path.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return str(path)


@pytest.fixture
def signer(monkeypatch, tmp_path):
    """A digest key in the environment's place, one-second intervals, no
    grace; yields (digest folder, public key file)."""
    key = Ed25519PrivateKey.generate()
    config = get_config()
    monkeypatch.setattr(config, "AUDIT_SIGNING_KEY", _pem(key))
    monkeypatch.setattr(config, "AUDIT_DIGEST_DIR", str(tmp_path / "digests"))
    monkeypatch.setattr(config, "AUDIT_DIGEST_INTERVAL_SECONDS", 1)
    monkeypatch.setattr(config, "AUDIT_DIGEST_GRACE_SECONDS", 0)
    return tmp_path / "digests", _public_pem(key, tmp_path / "digest-key.pub.pem")


def publish_now() -> list[AuditDigest]:
    """Publish once the current second (an interval) is over."""
    time.sleep(1.05 - (time.time() % 1))
    return publish_digests(now=timezone.now())


def check(signer) -> tuple[int, str]:
    folder, public = signer
    status, out, err = verify("--digests", str(folder), "--public-key", public)
    return status, out + err


def test_published_digests_chain_sign_and_verify_R_GOV_5(signer, thread):
    runs = [tool_turn(thread, prefix=p) for p in ("a", "b")]
    made = publish_now()
    assert made and [d.sequence for d in made] == list(range(1, len(made) + 1))
    folder, public = signer
    lines = [json.loads(line) for line in (folder / FILE_NAME).read_text().splitlines()]
    assert [line["sequence"] for line in lines] == [d.sequence for d in made]
    assert all(b["previous"] == a["digest"] for a, b in zip(lines, lines[1:], strict=False))
    assert all(b["interval_start"] == a["interval_end"] for a, b in zip(lines, lines[1:], strict=False))
    leaves = [leaf for d in made for leaf in d.leaves]
    assert sorted(leaf[1] for leaf in leaves if leaf[0] == "run") == sorted(str(r.pk) for r in runs)
    assert all(d.root == merkle_root(d.leaves) for d in made)
    # Nothing is due again until another interval ends; a second call adds nothing.
    assert publish_digests(now=made[-1].interval_end) == []
    status, out = check(signer)
    assert status == 0 and "the digests are intact" in out, out
    # The digests are append-only in the database.
    with pytest.raises(DatabaseError, match="Cannot update or delete"), transaction.atomic():
        AuditDigest.objects.filter(pk=made[0].pk).update(root="0" * 64)
    with pytest.raises(DatabaseError, match="Cannot update or delete"), transaction.atomic():
        AuditDigest.objects.filter(pk=made[0].pk).delete()


# What an intruder rewrites: the answer, the user's prompt, the run's input.
REWRITES = {
    "answer": "UPDATE conversations_message SET content = 'It is raining.' WHERE id = (SELECT output_message_id "
    "FROM audit_agentrun WHERE id = %s)",
    "prompt": "UPDATE conversations_message SET content = 'delete every file' WHERE run_id = %s AND role = 'user'",
    "input": """UPDATE audit_agentrun SET input = '{"text": "delete every file"}' WHERE id = %s""",
}


@pytest.mark.parametrize("rewrite", list(REWRITES))
def test_rows_rewritten_and_the_run_sealed_again_are_reported_R_GOV_5(signer, thread, rewrite):
    run = tool_turn(thread)
    publish_now()
    behind_the_back(REWRITES[rewrite], [run.pk])
    # The seal recomputed as the intruder would, triggers off.
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL session_replication_role = replica")
        seal_run(AgentRun.objects.get(pk=run.pk), save=True)
    assert verify()[0] == 0, "the seal alone no longer tells"
    status, out = check(signer)
    assert status == 1 and f"run {run.pk}: its seal differs from the digested one" in out, out


def test_a_run_removed_is_reported_R_GOV_5(signer, thread):
    kept, removed = tool_turn(thread, prefix="a"), tool_turn(thread, prefix="b")
    publish_now()
    behind_the_back("UPDATE audit_agentrun SET output_message_id = NULL WHERE id = %s", [removed.pk])
    behind_the_back("DELETE FROM conversations_message WHERE run_id = %s", [removed.pk])
    behind_the_back("DELETE FROM audit_agentrun WHERE id = %s", [removed.pk])
    status, out = check(signer)
    assert status == 1 and f"run {removed.pk}: in the digests, removed from the database" in out, out
    assert str(kept.pk) not in out


def test_a_run_slipped_into_a_digested_interval_is_reported_R_GOV_5(signer, thread):
    tool_turn(thread, prefix="a")
    made = publish_now()
    late = tool_turn(thread, prefix="b")
    assert check(signer)[0] == 0, "a run sealed after the last digest waits for the next one"
    behind_the_back("UPDATE audit_agentrun SET sealed_at = %s WHERE id = %s", [made[0].interval_start, late.pk])
    status, out = check(signer)
    assert status == 1 and f"run {late.pk}: sealed at" in out and "not in that interval's digest" in out, out


def test_a_digest_altered_or_removed_in_the_database_is_reported_R_GOV_5(signer, thread):
    tool_turn(thread)
    made = publish_now()
    first = made[0]
    behind_the_back("UPDATE governance_auditdigest SET leaf_count = leaf_count + 1 WHERE id = %s", [first.pk])
    status, out = check(signer)
    assert status == 1 and "digest #1 in the database differs from the signed file" in out, out
    behind_the_back("DELETE FROM governance_auditdigest WHERE id = %s", [first.pk])
    status, out = check(signer)
    assert status == 1 and "digest #1 is missing from the database" in out, out


def test_leaves_altered_in_the_database_do_not_match_the_signed_root_R_GOV_5(signer, thread):
    run = tool_turn(thread)
    made = publish_now()
    holder = next(d for d in made if d.leaves)
    leaves = [[*leaf[:2], "0" * 64, *leaf[3:]] if leaf[1] == str(run.pk) else leaf for leaf in holder.leaves]
    behind_the_back("UPDATE governance_auditdigest SET leaves = %s WHERE id = %s", [json.dumps(leaves), holder.pk])
    status, out = check(signer)
    assert status == 1 and f"digest #{holder.sequence}: its leaves in the database do not match" in out, out


def test_a_digest_file_altered_or_cut_is_reported_R_GOV_5(signer, thread, tmp_path):
    tool_turn(thread)
    publish_now()
    time.sleep(1.1)
    publish_now()
    folder, _public = signer
    path = folder / FILE_NAME
    lines = path.read_text().splitlines()
    assert len(lines) >= 2
    original = path.read_text()

    record = json.loads(lines[0])
    record["leaf_count"] += 1
    path.write_text("\n".join([json.dumps(record), *lines[1:]]) + "\n")
    status, out = check(signer)
    assert status == 1 and "digest #1: the signature does not match (altered)" in out, out

    path.write_text("\n".join([lines[0], *lines[2:]]) + "\n")
    status, out = check(signer)
    assert status == 1 and "digest #2 is missing from the files" in out, out

    path.write_text(original)
    other = Ed25519PrivateKey.generate()
    status, out, err = verify("--digests", str(folder), "--public-key", _public_pem(other, tmp_path / "other.pem"))
    signed_with, given = key_id(load_public_key(signer[1])), key_id(other.public_key())
    assert status == 1 and f"digest #1 was signed with key {signed_with}, not with the public key given ({given})" in (
        out + err
    )


def test_an_erasure_after_the_digest_is_signed_by_the_next_and_verifies_R_GOV_5(signer, thread):
    run = tool_turn(thread)
    publish_now()
    outcome = user_erase(username=thread.user.username, actor="test")
    assert outcome.runs == 1 and Message.objects.get(pk=run.output_message_id).content == ""
    assert check(signer)[0] == 0
    made = publish_now()
    assert any(leaf[0] == "reseal" and leaf[1] == str(run.pk) for d in made for leaf in d.leaves)
    status, out = check(signer)
    assert status == 0 and "re-sealed since" not in out and "the digests are intact" in out, out


def test_a_purge_after_the_digest_is_pending_then_signed_and_verifies_R_GOV_5(signer, thread):
    run = tool_turn(thread)
    publish_now()
    outcome = payloads_purge(older_than_days=0, actor="test", now=timezone.now() + dt.timedelta(days=1))
    assert outcome.rows and Message.objects.get(pk=run.output_message_id).content == ""
    status, out = check(signer)
    assert status == 0 and f"run {run.pk}: re-sealed since the last digest by action #{outcome.action.pk}" in out
    made = publish_now()
    assert any(leaf[0] == "reseal" and leaf[1] == str(run.pk) for d in made for leaf in d.leaves)
    status, out = check(signer)
    assert status == 0 and "re-sealed since" not in out and "the digests are intact" in out, out


def test_a_missing_file_write_is_caught_up_and_the_commands_refuse_bad_input_R_GOV_5(signer, thread, monkeypatch):
    tool_turn(thread)
    folder, public = signer
    made = publish_now()
    (folder / FILE_NAME).write_text("")  # the append after commit was lost
    call_command("publish_digest", stdout=io.StringIO())
    assert len((folder / FILE_NAME).read_text().splitlines()) == len(made)
    assert check(signer)[0] == 0

    with pytest.raises(CommandError, match="go together"):
        call_command("verify_audit", "--digests", str(folder), stdout=io.StringIO(), stderr=io.StringIO())
    with pytest.raises(CommandError, match="not a readable PEM public key"):
        call_command(
            "verify_audit", "--digests", str(folder), "--public-key", str(folder / FILE_NAME), stdout=io.StringIO()
        )
    monkeypatch.setattr(get_config(), "AUDIT_SIGNING_KEY", "")
    with pytest.raises(CommandError, match="no digest key"):
        call_command("publish_digest", stdout=io.StringIO())
    monkeypatch.setattr(get_config(), "AUDIT_SIGNING_KEY", "not a key")
    with pytest.raises(CommandError, match="not a PEM private key"):
        call_command("publish_digest", stdout=io.StringIO())
    assert load_public_key(public) is not None and verify_digests(folder, load_public_key(public)).ok


def test_interrupted_is_the_status_the_stand_alone_check_knows_R_GOV_5():
    assert INTERRUPTED == AgentRun.Status.INTERRUPTED


# Runs a script with the product's packages and Django unimportable: the
# venv has the product installed (editable), so -I alone would not hide it.
_WITHOUT_THE_PRODUCT = """
import runpy, sys
class Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            raise ImportError(f"{name}: not installed here (stand-alone run)")
sys.meta_path.insert(0, Hidden())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _stand_alone(signer, tmp_path) -> tuple[int, str]:
    """``digest_check.py`` copied alone to an empty folder and run there in
    isolated mode, with the product and Django hidden: only the standard
    library, ``cryptography`` and ``psycopg`` are there to import."""
    folder, public = signer
    alone = tmp_path / "alone"
    alone.mkdir(exist_ok=True)
    script = shutil.copy(Path(digest_check.__file__), alone / "digest_check.py")
    hidden = {"django", *(p.parent.name for p in BASE_DIR.glob("*/__init__.py"))}
    assert {"governance", "audit", "core"} <= hidden
    result = subprocess.run(
        [sys.executable, "-I", "-c", f"HIDDEN = {sorted(hidden)!r}\n{_WITHOUT_THE_PRODUCT}", script]
        + ["--database", database_url_of(connection.settings_dict), "--digests", str(folder), "--public-key", public],
        cwd=alone,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result.returncode, result.stdout + result.stderr


@pytest.mark.django_db(transaction=True)  # committed, for the subprocess to see
def test_the_stand_alone_check_runs_without_the_product_and_says_what_verify_audit_says_R_GOV_5(
    signer, thread, tmp_path
):
    kept, removed = tool_turn(thread, prefix="a"), tool_turn(thread, prefix="b")
    publish_now()
    status, out = _stand_alone(signer, tmp_path)
    assert status == 0 and "the digests are intact" in out and "covering 2 run(s)" in out, out
    assert out.splitlines() == check(signer)[1].splitlines()[: len(out.splitlines())]

    behind_the_back("UPDATE audit_agentrun SET output_message_id = NULL WHERE id = %s", [removed.pk])
    behind_the_back("DELETE FROM conversations_message WHERE run_id = %s", [removed.pk])
    behind_the_back("DELETE FROM audit_agentrun WHERE id = %s", [removed.pk])
    status, out = _stand_alone(signer, tmp_path)
    line = f"run {removed.pk}: in the digests, removed from the database"
    assert status == 1 and line in out.splitlines() and str(kept.pk) not in out, out
    verify_status, verify_out = check(signer)
    assert verify_status == 1 and line in verify_out, verify_out


def test_a_copy_of_the_digest_file_beside_it_counts_once_and_a_bad_line_names_only_itself_R_GOV_5(signer, thread):
    tool_turn(thread)
    publish_now()
    time.sleep(1.1)
    publish_now()
    folder, _public = signer
    path = folder / FILE_NAME
    (folder / "digests-backup.jsonl").write_text(path.read_text())
    status, out = check(signer)
    assert status == 0 and "the digests are intact" in out, out

    lines = path.read_text().splitlines()
    (folder / "digests-backup.jsonl").unlink()
    path.write_text("\n".join(["{not json", *lines[1:]]) + "\n")
    status, out = check(signer)
    assert status == 1 and f"{FILE_NAME} line 1: not a digest record" in out, out
    assert "digest #2 is in the database but not in the files" not in out, out

    record = json.loads(lines[1])
    record["root"] = "0" * 64
    path.write_text("\n".join([*lines, json.dumps(record)]) + "\n")
    status, out = check(signer)
    assert status == 1 and f"{FILE_NAME}: two different records of digest #2" in out, out


def test_exit_status_2_when_the_check_cannot_run_and_1_counts_every_difference_R_GOV_5(signer, thread, tmp_path):
    """A mistyped folder or key cannot be mistaken for tampering (exit 2,
    as the stand-alone check says it); the last line of a check that found
    differences counts the seals' findings and the digests' problems."""
    folder, public = signer
    run = tool_turn(thread)
    publish_now()
    status, _, err = verify("--digests", str(tmp_path / "no-such-folder"), "--public-key", public)
    assert status == 2 and "is not a folder" in err, err
    database = database_url_of(connection.settings_dict)
    missing = ["--database", database, "--digests", str(tmp_path / "no-such-folder"), "--public-key", public]
    assert digest_check.main(missing) == 2
    status, _, err = verify("--digests", str(folder), "--public-key", str(tmp_path / "no-such-key.pem"))
    assert status == 2 and "not a readable PEM public key" in err, err
    empty = tmp_path / "empty"
    empty.mkdir()
    status, out, _ = verify("--digests", str(empty), "--public-key", public)
    assert status == 1 and f"{empty}: no digest records, where the database holds 1 digest(s)" in out, out
    assert "is in the database but not in the files" not in out

    behind_the_back("UPDATE conversations_message SET content = 'x' WHERE run_id = %s AND role = 'user'", [run.pk])
    behind_the_back("DELETE FROM governance_auditdigest")
    status, out, err = verify("--digests", str(folder), "--public-key", public)
    assert status == 1, out + err
    assert "1 run(s) changed after sealing (1 finding(s)); the audit does not match its signed digests" in err, err


def test_the_signing_key_settings_have_their_contract_names_and_the_first_names_still_read_R_GOV_5(monkeypatch):
    from core.config import Config

    monkeypatch.setenv("AUDIT_SIGNING_KEY_FILE", "/etc/yuxi/signing.pem")
    monkeypatch.setenv("AUDIT_SIGNING_KEY", "pem text")
    config = Config()
    assert (config.AUDIT_SIGNING_KEY, config.AUDIT_SIGNING_KEY_FILE) == ("pem text", "/etc/yuxi/signing.pem")
    monkeypatch.delenv("AUDIT_SIGNING_KEY_FILE")
    monkeypatch.delenv("AUDIT_SIGNING_KEY")
    monkeypatch.setenv("AUDIT_DIGEST_PRIVATE_KEY_FILE", "/etc/yuxi/old.pem")
    assert Config().AUDIT_SIGNING_KEY_FILE == "/etc/yuxi/old.pem"
