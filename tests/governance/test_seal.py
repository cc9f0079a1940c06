"""Sealed runs (R-GOV-3, R-GOV-4): the terminal transaction seals the run;
verify_audit is green on untouched runs and names every row changed,
removed, added or moved in sequence behind the application's back, in every
run; each fact field of a row is sealed; seals made under version 1 stay
verifiable; runs from before sealing are unsealed, not broken."""

from __future__ import annotations

import datetime as dt
import json
import uuid

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from audit import ledger
from audit.models import AgentRun
from conversations.models import Conversation, Message
from governance.seal import (
    FACT_FIELDS,
    RUN_BOOKKEEPING_FIELDS,
    RUN_FACT_FIELDS,
    SEAL_VERSION,
    audit_row_facts,
    chain,
    compute_seal,
    recompute_seal,
    row_digest,
    run_digest,
)
from tests.conftest import acquire, make_run
from tests.read.builders import tool_turn

from .helpers import behind_the_back, verify

pytestmark = pytest.mark.django_db


def test_terminal_transaction_seals_the_run_over_its_closed_rows_R_GOV_3(thread):
    run = tool_turn(thread)
    run.refresh_from_db()
    rows = Message.objects.audit().filter(run=run)
    prompt = Message.objects.get(run=run, role="user")
    # The run's own facts, its prompt, then its audit rows in timeline order.
    assert run.sealed_at is not None and run.seal_row_count == rows.count() + 1 == 4
    assert len(run.seal_head) == 64
    assert [entry[0] for entry in run.seal_rows] == [
        "run",
        prompt.pk,
        *rows.order_by("sequence", "id").values_list("id", flat=True),
    ]
    assert recompute_seal(run.pk).head == run.seal_head
    status, out, _ = verify()
    assert status == 0 and "1 sealed, 0 unsealed" in out and "0 changed after sealing" in out


@pytest.mark.usefixtures("recovery_fail")
def test_every_terminal_path_seals_cancel_and_the_lease_sweeper_R_GOV_3(thread):
    pending = make_run(thread)
    ledger.run_request_cancel(user=thread.user, run_id=pending.id)
    crashed = make_run(thread)
    lease = acquire(crashed, ttl=60)
    ledger.model_call_start(
        lease=lease, operation_id="lc_run--x", sequence=1, started_at=timezone.now(), metadata={"namespace": []}
    )
    AgentRun.objects.filter(pk=crashed.pk).update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))
    ledger.run_sweep_expired_leases()
    for run in (pending, crashed):
        run.refresh_from_db()
        assert run.is_terminal and run.sealed_at is not None, run.status
    # Its prompt and its one model call.
    assert crashed.status == "failed" and crashed.seal_row_count == 2
    assert verify()[0] == 0


def test_a_changed_row_is_named_and_the_exit_status_is_1_R_GOV_3(thread):
    run = tool_turn(thread, prefix="a")
    other = tool_turn(thread, prefix="b")
    tool_row = Message.objects.get(run=run, role="tool")
    behind_the_back("UPDATE conversations_message SET content = 'forged' WHERE id = %s", [tool_row.pk])
    status, out, err = verify()
    assert status == 1
    assert f"run {run.pk}: row {tool_row.pk} changed after sealing (tool call_a, sequence 2)" in out
    assert str(other.pk) not in out
    assert "1 run(s) changed after sealing" in err and "checked 2/2 runs" in err
    # Only that run, by id, and only runs finished since a date.
    assert verify("--run", str(other.pk))[0] == 0
    assert verify("--run", str(run.pk))[0] == 1
    tomorrow = (timezone.now() + dt.timedelta(days=1)).date().isoformat()
    assert verify("--since", tomorrow)[1].startswith("no terminal runs")


def test_a_removed_and_an_added_row_are_named_R_GOV_3(thread):
    removed = tool_turn(thread, prefix="a")
    added = tool_turn(thread, prefix="b")
    first = Message.objects.get(run=removed, role="tool")
    behind_the_back("DELETE FROM conversations_message WHERE id = %s", [first.pk])
    extra = Message.objects.create(
        thread=thread,
        run=added,
        role="tool",
        message_type="tool_audit",
        operation_id="call_smuggled",
        sequence=99,
        execution_status="completed",
        content="smuggled in",
    )
    status, out, _ = verify()
    assert status == 1
    assert f"run {removed.pk}: row {first.pk} removed after sealing" in out
    assert f"run {added.pk}: row {extra.pk} added after sealing (tool call_smuggled, sequence 99)" in out


def test_an_edited_seal_is_caught_too_R_GOV_3(thread):
    run = tool_turn(thread)
    behind_the_back("UPDATE audit_agentrun SET seal_head = repeat('0', 64) WHERE id = %s", [run.pk])
    status, out, _ = verify()
    assert status == 1 and f"run {run.pk}: the stored seal was changed" in out


def test_runs_that_ended_before_sealing_are_reported_unsealed_not_broken_R_GOV_3(thread):
    tool_turn(thread)
    legacy = tool_turn(thread, prefix="old")
    behind_the_back(
        "UPDATE audit_agentrun SET seal_head = '', seal_row_count = NULL, seal_rows = NULL, sealed_at = NULL "
        "WHERE id = %s",
        [legacy.pk],
    )
    status, out, _ = verify()
    assert status == 0 and "1 sealed, 1 unsealed (ended before sealing existed)" in out


def test_bad_arguments_are_refused_with_exit_status_2_R_GOV_3(thread):
    """1 says the audit differs; a check that could not run says 2."""
    status, _, err = verify("--run", "not-a-uuid")
    assert status == 2 and "is not a run id" in err
    status, _, err = verify("--run", "6f1c2a44-0000-4000-8000-000000000000")
    assert status == 2 and "no run" in err
    status, _, err = verify("--since", "yesterday-ish")
    assert status == 2 and "not a date" in err
    assert verify("--batch-size", "0")[0] == 2


# --------------------------------------------------------------------------
# Every row named, every fact sealed (R-GOV-4, issue 32 item 6)
# --------------------------------------------------------------------------


def _timeline(run) -> list[Message]:
    return list(Message.objects.audit().filter(run=run).order_by("sequence", "id"))


def test_two_rows_swapped_in_sequence_are_both_named_R_GOV_4(thread):
    run = tool_turn(thread)
    first, second, _answer = _timeline(run)
    behind_the_back(
        "UPDATE conversations_message SET sequence = CASE id WHEN %s THEN %s ELSE %s END WHERE id IN (%s, %s)",
        [first.pk, second.sequence, first.sequence, first.pk, second.pk],
    )
    status, out, err = verify()
    assert status == 1
    assert f"run {run.pk}: row {first.pk} moved in sequence after sealing (assistant lc_run--a1, sequence 2; " in out
    assert f"run {run.pk}: row {second.pk} moved in sequence after sealing (tool call_a, sequence 1; " in out
    assert f"row {_answer.pk}" not in out
    assert "1 run(s) changed after sealing (2 finding(s))" in err


def test_every_changed_removed_and_added_row_of_every_run_is_named_R_GOV_4(thread):
    run = tool_turn(thread, prefix="a")
    other = tool_turn(thread, prefix="b")
    model, tool, answer = _timeline(run)
    behind_the_back(
        "UPDATE conversations_message SET content = content || ' forged' WHERE id IN (%s, %s)", [model.pk, answer.pk]
    )
    behind_the_back("DELETE FROM conversations_message WHERE id = %s", [tool.pk])
    extra = Message.objects.create(
        thread=thread,
        run=run,
        role="tool",
        message_type="tool_audit",
        operation_id="call_smuggled",
        sequence=99,
        execution_status="completed",
    )
    other_rows = _timeline(other)
    behind_the_back(
        "UPDATE conversations_message SET tool_input = '{}', duration_ms = 7 WHERE id IN (%s, %s)",
        [other_rows[1].pk, other_rows[2].pk],
    )
    status, out, err = verify()
    assert status == 1
    assert f"run {run.pk}: row {model.pk} changed after sealing (assistant lc_run--a1, sequence 1)" in out
    assert f"run {run.pk}: row {answer.pk} changed after sealing (assistant lc_run--a2, sequence 3)" in out
    assert f"run {run.pk}: row {tool.pk} removed after sealing" in out
    assert f"run {run.pk}: row {extra.pk} added after sealing (tool call_smuggled, sequence 99)" in out
    assert f"run {other.pk}: row {other_rows[1].pk} changed after sealing" in out
    assert f"run {other.pk}: row {other_rows[2].pk} changed after sealing" in out
    assert f"row {other_rows[0].pk} " not in out
    assert "2 runs: 2 sealed, 0 unsealed (ended before sealing existed), 2 changed after sealing" in out
    assert "2 run(s) changed after sealing (6 finding(s))" in err


# One change per fact field, made behind the application's back to the
# run's last row (so that only its digest, not its place, can betray it).
_ID_SHIFT = 1_000_000
SEALED_CHANGES = {
    "id": f"id = id + {_ID_SHIFT}",
    "run_id": "run_id = gen_random_uuid()",
    "thread_id": "thread_id = gen_random_uuid()",
    "role": "role = 'system'",
    "message_type": "message_type = 'model_audit'",
    "operation_id": "operation_id = operation_id || '-forged'",
    "sequence": "sequence = sequence + 100",
    "execution_status": "execution_status = 'abandoned'",
    "started_at": "started_at = COALESCE(started_at, now()) - interval '1 second'",
    "finished_at": "finished_at = COALESCE(finished_at, now()) - interval '1 second'",
    "duration_ms": "duration_ms = COALESCE(duration_ms, 0) + 1",
    "usage": """usage = '{"input_tokens": 999999}'""",
    "usage_cause": "usage_cause = 'forged'",
    "cost_usd": "cost_usd = COALESCE(cost_usd, 0) + 1",
    "price_source": "price_source = price_source || '-forged'",
    "price_version": "price_version = price_version || '-forged'",
    "content": "content = content || ' forged'",
    "tool_calls": """tool_calls = '[{"id": "call_forged", "name": "rm", "args": {}}]'""",
    "tool_name": "tool_name = tool_name || '-forged'",
    "tool_input": """tool_input = '{"forged": true}'""",
    "declared_by_id": "declared_by_id = id",
    "namespace": """namespace = '["tools:forged"]'""",
    "parent_operation_id": "parent_operation_id = 'call_forged'",
    "effect_key": "effect_key = COALESCE(effect_key, '') || '-forged'",
    "replayed_from_id": "replayed_from_id = id",
    "attempt": "attempt = attempt + 1",
    "metadata": """metadata = metadata || '{"forged": true}'""",
}


def test_the_seal_covers_every_fact_field_of_a_row_R_GOV_4():
    """Every field of a message row is sealed but the bookkeeping
    ``created_at``/``updated_at``; a field added later must be sealed (or
    named bookkeeping here), and has a case below."""
    fields = {field.attname for field in Message._meta.concrete_fields}
    assert set(FACT_FIELDS) == fields - {"created_at", "updated_at"}
    assert set(SEALED_CHANGES) == set(FACT_FIELDS)


@pytest.mark.parametrize("fact", list(SEALED_CHANGES))
def test_each_fact_field_is_sealed_R_GOV_4(thread, fact):
    run = tool_turn(thread)
    row = _timeline(run)[-1]
    before = Message.objects.filter(pk=row.pk).values(*FACT_FIELDS).get()
    behind_the_back(f"UPDATE conversations_message SET {SEALED_CHANGES[fact]} WHERE id = %s", [row.pk])
    if fact == "id":  # the run's answer moves with it (the foreign key is checked at the end of the test)
        behind_the_back(
            "UPDATE audit_agentrun SET output_message_id = output_message_id + %s WHERE id = %s", [_ID_SHIFT, run.pk]
        )
    after = Message.objects.filter(pk=row.pk + _ID_SHIFT if fact == "id" else row.pk).values(*FACT_FIELDS).get()
    assert after[fact] != before[fact]
    assert row_digest(after) != row_digest(before)
    status, out, _ = verify()
    assert status == 1 and f"run {run.pk}: row {row.pk} " in out


# --------------------------------------------------------------------------
# Seal versions: old seals stay verifiable (R-GOV-4)
# --------------------------------------------------------------------------


# One tool row of a subagent, sealed under every version (R-GOV-4).
_ROW_FACTS = {
    "id": 41,
    "run_id": uuid.UUID("6f1c2a44-0000-4000-8000-000000000001"),
    "thread_id": uuid.UUID("6f1c2a44-0000-4000-8000-000000000002"),
    "role": "tool",
    "message_type": "tool_audit",
    "operation_id": "call_a",
    "sequence": 2,
    "execution_status": "completed",
    "started_at": dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC),
    "finished_at": dt.datetime(2026, 1, 2, 3, 4, 6, tzinfo=dt.UTC),
    "duration_ms": 1321,
    "usage": None,
    "usage_cause": None,
    "cost_usd": None,
    "price_source": "",
    "price_version": "",
    "content": "sunny",
    "tool_calls": None,
    "tool_name": "get_weather",
    "tool_input": {"city": "Paris"},
    "declared_by_id": 40,
    "metadata": {"namespace": ["tools:t1"]},
}


# The same row with every fact version 3 seals.
_ROW_FACTS_V3 = {
    **_ROW_FACTS,
    "namespace": ["tools:t1"],
    "parent_operation_id": "call_task",
    "effect_key": "k",
    "replayed_from_id": 7,
    "attempt": 2,
}


def test_version_1_encoding_and_chain_are_unchanged_R_GOV_4():
    """The digest and head the seal's first version gave this row (computed
    by the code before version 2 existed): seals made then verify for ever."""
    run_id = uuid.UUID("6f1c2a44-0000-4000-8000-000000000001")
    facts = {**_ROW_FACTS, "namespace": ["tools:t1"], "parent_operation_id": "call_task"}
    digest = row_digest(facts, version=1)
    assert digest == "48389a43a8a648e0f025c5e2ffc907c7fe6c0e6dc65db2ed588b7573aacfa543"
    assert chain(run_id, [(41, digest)], version=1).head == (
        "e1037d2e6c62885893db23f5fe48345ad4e3471de0c438ec2eab9f221790ef0c"
    )
    # Version 2 seals the namespace and the parent; version 1 did not.
    assert row_digest({**facts, "namespace": []}, version=1) == digest
    assert row_digest({**facts, "namespace": []}, version=2) != row_digest(facts, version=2)
    assert row_digest({**facts, "parent_operation_id": None}, version=2) != row_digest(facts, version=2)


def test_version_2_encoding_and_chain_are_unchanged_R_GOV_4():
    """The digest and head version 2 gave this row (computed by the code
    before version 3 existed): runs sealed under it verify for ever, and the
    effect ledger's facts, which it never sealed, do not enter it."""
    run_id = uuid.UUID("6f1c2a44-0000-4000-8000-000000000001")
    facts = _ROW_FACTS_V3
    digest = row_digest(facts, version=2)
    assert digest == "f8baac2c35cf2b17eec8cc5a08992697026b330199bd45c7d9e5b73b75c531d3"
    assert chain(run_id, [(41, digest)], version=2).head == (
        "63e9194b65e96e733dba1f6896bb9b9945ed2a9d8b8fc7cad2febd9a20ab126d"
    )
    # Version 3 seals the effect key, the replayed-from row and the attempt.
    for fact, other in (("effect_key", None), ("replayed_from_id", None), ("attempt", 1)):
        assert row_digest({**facts, fact: other}, version=2) == digest
        assert row_digest({**facts, fact: other}) != row_digest(facts)


def _seal_under_version_1(run) -> None:
    seal = compute_seal(run.pk, audit_row_facts([run.pk])[run.pk], version=1)
    behind_the_back(
        "UPDATE audit_agentrun SET seal_head = %s, seal_row_count = %s, seal_rows = %s, seal_version = NULL "
        "WHERE id = %s",
        [seal.head, seal.row_count, json.dumps(seal.rows), run.pk],
    )


def test_a_run_sealed_under_version_1_still_verifies_and_its_changes_are_named_R_GOV_4(thread):
    run = tool_turn(thread)
    assert AgentRun.objects.get(pk=run.pk).seal_version == SEAL_VERSION == 4
    model, tool, _answer = _timeline(run)
    # A subagent's rows sealed before version 2: their namespace and parent
    # were not sealed, and the seal stays valid all the same.
    behind_the_back(
        """UPDATE conversations_message SET namespace = '["tools:t1"]', parent_operation_id = 'call_task' """
        "WHERE id = %s",
        [tool.pk],
    )
    _seal_under_version_1(run)
    status, out, _ = verify()
    assert status == 0 and "1 sealed, 0 unsealed" in out and "0 changed after sealing" in out
    behind_the_back("""UPDATE conversations_message SET tool_input = '{"city": "Oslo"}' WHERE id = %s""", [tool.pk])
    status, out, _ = verify()
    assert status == 1 and f"run {run.pk}: row {tool.pk} changed after sealing (tool call_a, sequence 2)" in out
    assert f"row {model.pk} " not in out


def test_a_run_sealed_under_version_2_still_verifies_and_its_changes_are_named_R_GOV_4(thread):
    run = tool_turn(thread)
    model, tool, _answer = _timeline(run)
    # Rows sealed before version 3: the effect ledger's facts were not
    # sealed (a replay's facts, set here, changed no version 2 digest).
    behind_the_back(
        "UPDATE conversations_message SET effect_key = 'k-before-v3', replayed_from_id = %s, attempt = 2 WHERE id = %s",
        [model.pk, tool.pk],
    )
    seal = compute_seal(run.pk, audit_row_facts([run.pk])[run.pk], version=2)
    behind_the_back(
        "UPDATE audit_agentrun SET seal_head = %s, seal_row_count = %s, seal_rows = %s, seal_version = 2 WHERE id = %s",
        [seal.head, seal.row_count, json.dumps(seal.rows), run.pk],
    )
    status, out, _ = verify()
    assert status == 0 and "1 sealed, 0 unsealed" in out and "0 changed after sealing" in out
    behind_the_back("""UPDATE conversations_message SET tool_input = '{"city": "Oslo"}' WHERE id = %s""", [tool.pk])
    status, out, _ = verify()
    assert status == 1 and f"run {run.pk}: row {tool.pk} changed after sealing (tool call_a, sequence 2)" in out
    assert f"row {model.pk} " not in out


def test_a_seal_passed_off_as_another_version_is_caught_R_GOV_4(thread):
    run = tool_turn(thread)
    behind_the_back("UPDATE audit_agentrun SET seal_version = NULL WHERE id = %s", [run.pk])
    status, out, _ = verify()
    assert status == 1 and f"run {run.pk}: row" in out


def test_the_namespace_and_parent_of_a_sealed_runs_row_are_append_only_R_GOV_4(thread):
    run = tool_turn(thread)
    row = _timeline(run)[-1]
    for assignment in ("""namespace = '["tools:forged"]'""", "parent_operation_id = 'call_forged'"):
        with pytest.raises(IntegrityError, match="sealed run"), transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(f"UPDATE conversations_message SET {assignment} WHERE id = %s", [row.pk])
    with pytest.raises(IntegrityError, match="sealed"), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("UPDATE audit_agentrun SET seal_version = 1 WHERE id = %s", [run.pk])


def test_the_effect_ledger_facts_of_a_closed_row_and_a_sealed_runs_attempt_are_append_only_R_EFF_1(thread):
    run = tool_turn(thread)
    tool = _timeline(run)[1]
    assert tool.role == "tool"
    for assignment in ("effect_key = 'forged'", "replayed_from_id = id", "attempt = 2"):
        with pytest.raises(IntegrityError, match="closed"), transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(f"UPDATE conversations_message SET {assignment} WHERE id = %s", [tool.pk])
    with pytest.raises(IntegrityError, match="sealed"), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("UPDATE audit_agentrun SET attempt = 2 WHERE id = %s", [run.pk])


# --------------------------------------------------------------------------
# Version 4: the run's own facts and its prompt (R-GOV-3)
# --------------------------------------------------------------------------


def test_a_rewritten_prompt_is_named_and_refused_by_the_triggers_R_GOV_3(thread):
    run = tool_turn(thread)
    prompt = Message.objects.get(run=run, role="user")
    behind_the_back("UPDATE conversations_message SET content = 'delete every file' WHERE id = %s", [prompt.pk])
    status, out, _ = verify()
    assert status == 1 and f"run {run.pk}: row {prompt.pk} changed after sealing (the user's message)" in out
    behind_the_back("DELETE FROM conversations_message WHERE id = %s", [prompt.pk])
    status, out, _ = verify()
    assert status == 1 and f"run {run.pk}: row {prompt.pk} removed after sealing" in out
    # Without the intruder's rights, the triggers refuse both.
    other = tool_turn(thread, prefix="b")
    prompt = Message.objects.get(run=other, role="user")
    for sql in (
        "UPDATE conversations_message SET content = 'x' WHERE id = %s",
        "DELETE FROM conversations_message WHERE id = %s",
    ):
        with pytest.raises(IntegrityError, match="prompt of sealed run"), transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(sql, [prompt.pk])
    # Bookkeeping alone still moves.
    Message.objects.filter(pk=prompt.pk).update(updated_at=timezone.now())


def test_a_prompt_is_free_until_its_run_is_sealed_R_GOV_3(thread):
    run = make_run(thread)
    prompt = Message.objects.get(run=run, role="user")
    Message.objects.filter(pk=prompt.pk).update(content="still editable")
    assert Message.objects.get(pk=prompt.pk).content == "still editable"


# One change per fact of the run itself, made behind the application's back.
SEALED_RUN_CHANGES = {
    "id": None,  # the chain's first link hashes it: a run moved to another id is a seal for another run
    "thread_id": "thread_id = (SELECT id FROM conversations_conversation WHERE id <> thread_id LIMIT 1)",
    "user_id": "user_id = (SELECT id FROM auth_user WHERE id <> user_id LIMIT 1)",
    "turn_id": "turn_id = gen_random_uuid()",
    "resumed_from_id": "resumed_from_id = (SELECT id FROM audit_agentrun r WHERE r.id <> audit_agentrun.id LIMIT 1)",
    "request_id": "request_id = request_id || '-forged'",
    "agent_id": "agent_id = agent_id || '-forged'",
    "model": "model = model || '-forged'",
    "input": """input = '{"text": "forged"}'""",
    "status": "status = 'failed'",
    "attempt": "attempt = attempt + 1",
    "started_at": "started_at = COALESCE(started_at, now()) - interval '1 second'",
    "finished_at": "finished_at = finished_at - interval '1 second'",
    "usage": """usage = '{"input_tokens": 1}'""",
    "error_type": "error_type = 'forged'",
    "error_message": "error_message = 'forged'",
    "interrupts": """interrupts = '[{"value": "forged"}]'""",
    "output_message_id": "output_message_id = NULL",
    "replay_of": "replay_of = 'forged'",
}


def test_the_seal_covers_every_fact_of_the_run_R_GOV_3():
    """Every field of a run is sealed (version 4) or named bookkeeping; a
    field added later must be one or the other, and has a case below."""
    fields = {field.attname for field in AgentRun._meta.concrete_fields}
    assert set(RUN_FACT_FIELDS) | set(RUN_BOOKKEEPING_FIELDS) == fields
    assert not set(RUN_FACT_FIELDS) & set(RUN_BOOKKEEPING_FIELDS)
    assert set(SEALED_RUN_CHANGES) == set(RUN_FACT_FIELDS)


@pytest.mark.parametrize("fact", [fact for fact, change in SEALED_RUN_CHANGES.items() if change])
def test_each_fact_of_the_run_is_sealed_and_append_only_R_GOV_3(thread, other_user, fact):
    # Another user's thread and run, for the facts that point elsewhere.
    tool_turn(Conversation.objects.create(user=other_user, agent_id="assistant", model="replay:tool_then_answer"))
    run = tool_turn(thread, prefix="b")
    change = f"UPDATE audit_agentrun SET {SEALED_RUN_CHANGES[fact]} WHERE id = %s"
    with pytest.raises(IntegrityError, match="is sealed"), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(change, [run.pk])
    behind_the_back(change, [run.pk])
    assert getattr(AgentRun.objects.get(pk=run.pk), fact) != getattr(run, fact)
    status, out, _ = verify()
    assert status == 1 and f"run {run.pk}: the run's own facts changed after sealing (one of its input," in out
    assert "1 changed after sealing" in out and f"run {run.pk}: row" not in out


def test_a_run_sealed_under_version_3_still_verifies_without_its_prompt_R_GOV_4(thread):
    run = tool_turn(thread)
    model, tool, _answer = _timeline(run)
    seal = compute_seal(run.pk, audit_row_facts([run.pk])[run.pk], version=3)
    assert seal.row_count == 3 and [entry[0] for entry in seal.rows] == [model.pk, tool.pk, _answer.pk]
    behind_the_back(
        "UPDATE audit_agentrun SET seal_head = %s, seal_row_count = %s, seal_rows = %s, seal_version = 3 WHERE id = %s",
        [seal.head, seal.row_count, json.dumps(seal.rows), run.pk],
    )
    # Version 3 never sealed the prompt nor the run's input.
    behind_the_back("UPDATE conversations_message SET content = 'other' WHERE run_id = %s AND role = 'user'", [run.pk])
    behind_the_back("""UPDATE audit_agentrun SET input = '{"text": "other"}' WHERE id = %s""", [run.pk])
    status, out, _ = verify()
    assert status == 0 and "0 changed after sealing" in out
    behind_the_back("""UPDATE conversations_message SET tool_input = '{"city": "Oslo"}' WHERE id = %s""", [tool.pk])
    status, out, _ = verify()
    assert status == 1 and f"run {run.pk}: row {tool.pk} changed after sealing (tool call_a, sequence 2)" in out


# What version 4 gave the run below when it was introduced: pinned, so that
# a later change of the encoding shows here and not in old seals.
PINNED_RUN_DIGEST = "a9233f4907885845dc11af048b27cc378724dad2c612f49cc9fa14b96d9ac8bc"
PINNED_V4_HEAD = "d5c351523a119d8edc06fa2781dfeb89da5d55f8934c5293f8baba8923ef4f2a"


def test_version_3_encoding_and_chain_are_unchanged_and_version_4_is_pinned_R_GOV_4():
    """The digest and head version 3 gave this row (computed by the code
    before version 4 existed), and what version 4 gives it with the run's
    facts: a seal verifies for ever under its version."""
    run_id = uuid.UUID("6f1c2a44-0000-4000-8000-000000000001")
    facts = _ROW_FACTS_V3
    digest = row_digest(facts, version=3)
    assert digest == "6f792874a5cc1af0740ac596ff65642dfbbfd7912a549f41a56dd6ff75d33739"
    assert chain(run_id, [(41, digest)], version=3).head == (
        "e58873adbccf48f5e3be756061f4ceddefd1ecadc257cca5c40ea2d86fca6f9b"
    )
    run = {name: None for name in RUN_FACT_FIELDS} | {
        "id": run_id,
        "thread_id": facts["thread_id"],
        "user_id": 3,
        "input": {"text": "weather in Paris?"},
        "status": "completed",
        "attempt": 1,
        "finished_at": dt.datetime(2026, 1, 2, 3, 4, 7, tzinfo=dt.UTC),
    }
    assert row_digest(facts, version=4) == digest
    with pytest.raises(ValueError, match="run's own facts"):
        chain(run_id, [(41, digest)], version=4)
    assert run_digest(run) == PINNED_RUN_DIGEST
    seal = chain(run_id, [(41, digest)], version=4, run=run_digest(run))
    assert seal.head == PINNED_V4_HEAD
    assert seal.rows == [["run", PINNED_RUN_DIGEST[:16]], [41, digest[:16]]] and seal.row_count == 1
    assert run_digest({**run, "input": {"text": "weather in Oslo?"}}) != run_digest(run)
