"""Append-only audit in the database (R-GOV-3): django-pgtrigger triggers
declared on ``AgentRun``, ``Message`` and ``RunRollback`` (so their
migrations own them).

What they refuse, unless the transaction names an open governance action
(the audited bypass, :func:`governance.bypass.audited_bypass`):

* UPDATE of a **closed** audit row's facts — run, thread, role, operation
  id, sequence, status, timestamps, duration, usage and its cause, tool
  name and input, declaring row, effect key, replayed-from row and attempt
  (R-EFF-1) — and overwriting its content, declared tool calls, cost or
  raw output once set. The terminal reconcile may still *fill* what the
  stream left empty (content, tool calls, cost) and add metadata proofs
  (``state_reconciled``), and binding makes the answer row ``text``: those
  happen before the run is sealed.
* Once the run is **sealed**, any change of a row's sealed facts at all
  (content, tool calls, type, cost and price, metadata, subagent namespace
  and parent too).
* UPDATE of a sealed run's seal, status, input, output, start and end
  time, attempt, usage, error, pending approval, identity (thread, user, turn, resumed run, request
  id, agent, model) or replay mark (``replay_of``: relabelling a sealed run
  would move it into or out of every figure) (an
  ``interrupted`` run excepted: cancelling its pending approval ends it
  again, and that terminal transaction seals it again).
* UPDATE or DELETE of a sealed run's user message (its prompt, sealed with
  the run from seal version 4).
* DELETE of audit rows and of runs (a thread or user deleted with its runs
  cascades into this and is refused the same way).
* UPDATE or DELETE of a run's rollback mark (``RunRollback``, R-API-2):
  it is written after the run may be sealed, so it is append-only on its
  own rather than through the seal.

Rows still ``running`` and ordinary chat messages are not restricted: the
lifecycle writes them under the run's lease (R-RUN-4). TRUNCATE fires no row
trigger. ``created_at``/``updated_at`` are bookkeeping, not facts.

The bypass is "audited": the setting must hold the id of a
``GovernanceAction`` row that is still open, so every change that passes
names who made it, when and why.
"""

from __future__ import annotations

import pgtrigger

BYPASS_SETTING = "yuxi.governance_action"

_BYPASS = f"""(
    COALESCE(current_setting('{BYPASS_SETTING}', true), '') <> ''
    AND EXISTS (
        SELECT 1 FROM governance_governanceaction
        WHERE id = NULLIF(current_setting('{BYPASS_SETTING}', true), '')::bigint AND finished_at IS NULL
    )
)"""

# restrict_violation: Django raises IntegrityError.
_REFUSE = (
    "USING ERRCODE = 'restrict_violation', "
    "HINT = 'only purge_payloads, erase_user or an audited bypass (governance.bypass.audited_bypass) "
    "may change the audit'"
)

_CLOSED_FACTS = """
    (OLD.run_id, OLD.thread_id, OLD.role, OLD.operation_id, OLD.sequence, OLD.execution_status,
     OLD.started_at, OLD.finished_at, OLD.duration_ms, OLD.usage, OLD.usage_cause, OLD.tool_name,
     OLD.tool_input, OLD.declared_by_id, OLD.effect_key, OLD.replayed_from_id, OLD.attempt)
    IS DISTINCT FROM
    (NEW.run_id, NEW.thread_id, NEW.role, NEW.operation_id, NEW.sequence, NEW.execution_status,
     NEW.started_at, NEW.finished_at, NEW.duration_ms, NEW.usage, NEW.usage_cause, NEW.tool_name,
     NEW.tool_input, NEW.declared_by_id, NEW.effect_key, NEW.replayed_from_id, NEW.attempt)
    OR (OLD.content <> '' AND NEW.content IS DISTINCT FROM OLD.content)
    OR (OLD.tool_calls IS NOT NULL AND NEW.tool_calls IS DISTINCT FROM OLD.tool_calls)
    OR (OLD.cost_usd IS NOT NULL AND NEW.cost_usd IS DISTINCT FROM OLD.cost_usd)
    OR (OLD.metadata ? 'raw_output' AND NEW.metadata -> 'raw_output' IS DISTINCT FROM OLD.metadata -> 'raw_output')
"""

_SEALED_FACTS = """
    (OLD.content, OLD.tool_calls, OLD.message_type, OLD.cost_usd, OLD.price_source, OLD.price_version,
     OLD.metadata, OLD.namespace, OLD.parent_operation_id)
    IS DISTINCT FROM
    (NEW.content, NEW.tool_calls, NEW.message_type, NEW.cost_usd, NEW.price_source, NEW.price_version,
     NEW.metadata, NEW.namespace, NEW.parent_operation_id)
"""

closed_audit_facts = pgtrigger.Trigger(
    name="closed_audit_facts",
    when=pgtrigger.Before,
    operation=pgtrigger.Update,
    condition=pgtrigger.Condition("OLD.operation_id IS NOT NULL AND OLD.execution_status <> 'running'"),
    func=f"""
        IF {_BYPASS} THEN
            RETURN NEW;
        END IF;
        IF {_CLOSED_FACTS} THEN
            RAISE EXCEPTION 'audit row % is closed: its facts are append-only (R-GOV-3)', OLD.id {_REFUSE};
        END IF;
        IF {_SEALED_FACTS} AND EXISTS (
            SELECT 1 FROM audit_agentrun WHERE id = OLD.run_id AND sealed_at IS NOT NULL
        ) THEN
            RAISE EXCEPTION 'audit row % belongs to sealed run %: it is append-only (R-GOV-3)', OLD.id, OLD.run_id
                {_REFUSE};
        END IF;
        RETURN NEW;
    """,
)

audit_row_delete = pgtrigger.Trigger(
    name="audit_row_delete",
    when=pgtrigger.Before,
    operation=pgtrigger.Delete,
    condition=pgtrigger.Condition("OLD.operation_id IS NOT NULL"),
    func=f"""
        IF {_BYPASS} THEN
            RETURN OLD;
        END IF;
        RAISE EXCEPTION 'audit row % cannot be deleted: the audit is append-only (R-GOV-3)', OLD.id {_REFUSE};
    """,
)

run_delete = pgtrigger.Trigger(
    name="run_delete",
    when=pgtrigger.Before,
    operation=pgtrigger.Delete,
    func=f"""
        IF {_BYPASS} THEN
            RETURN OLD;
        END IF;
        RAISE EXCEPTION 'run % cannot be deleted: the audit is append-only (R-GOV-3)', OLD.id {_REFUSE};
    """,
)

sealed_run = pgtrigger.Trigger(
    name="sealed_run",
    when=pgtrigger.Before,
    operation=pgtrigger.Update,
    # An interrupted run may still end once more (cancelled while awaiting
    # approval, R-TA-5): its terminal transaction seals it again.
    condition=pgtrigger.Condition("OLD.sealed_at IS NOT NULL AND OLD.status <> 'interrupted'"),
    func=f"""
        IF {_BYPASS} THEN
            RETURN NEW;
        END IF;
        IF (OLD.seal_head, OLD.seal_row_count, OLD.seal_rows, OLD.seal_version, OLD.sealed_at, OLD.status,
            OLD.input, OLD.output_message_id, OLD.finished_at, OLD.attempt, OLD.replay_of,
            OLD.thread_id, OLD.user_id, OLD.turn_id, OLD.resumed_from_id, OLD.request_id, OLD.agent_id, OLD.model,
            OLD.started_at, OLD.usage, OLD.error_type, OLD.error_message, OLD.interrupts)
           IS DISTINCT FROM
           (NEW.seal_head, NEW.seal_row_count, NEW.seal_rows, NEW.seal_version, NEW.sealed_at, NEW.status,
            NEW.input, NEW.output_message_id, NEW.finished_at, NEW.attempt, NEW.replay_of,
            NEW.thread_id, NEW.user_id, NEW.turn_id, NEW.resumed_from_id, NEW.request_id, NEW.agent_id, NEW.model,
            NEW.started_at, NEW.usage, NEW.error_type, NEW.error_message, NEW.interrupts) THEN
            RAISE EXCEPTION
                'run % is sealed: its seal, input, status, output, identity and replay mark are append-only (R-GOV-3)',
                OLD.id
                {_REFUSE};
        END IF;
        RETURN NEW;
    """,
)

# The user's message of a run (no operation id): sealed with the run from
# seal version 4, so append-only once the run is sealed — an interrupted run
# too, whose prompt never changes either.
# A message's columns that are no fact: bookkeeping, and the search vector
# (generated from the content; still null in a BEFORE trigger's NEW).
_UNSEALED = "ARRAY['created_at', 'updated_at', 'search_vector']"

sealed_prompt = pgtrigger.Trigger(
    name="sealed_prompt",
    when=pgtrigger.Before,
    operation=pgtrigger.Update | pgtrigger.Delete,
    condition=pgtrigger.Condition("OLD.operation_id IS NULL AND OLD.run_id IS NOT NULL"),
    func=f"""
        IF {_BYPASS} THEN
            RETURN COALESCE(NEW, OLD);
        END IF;
        IF (TG_OP = 'DELETE'
            OR to_jsonb(OLD) - {_UNSEALED} IS DISTINCT FROM to_jsonb(NEW) - {_UNSEALED})
           AND EXISTS (SELECT 1 FROM audit_agentrun WHERE id = OLD.run_id AND sealed_at IS NOT NULL) THEN
            RAISE EXCEPTION 'message % is the prompt of sealed run %: it is append-only (R-GOV-3)', OLD.id, OLD.run_id
                {_REFUSE};
        END IF;
        RETURN COALESCE(NEW, OLD);
    """,
)

# A rollback mark (audit.models.RunRollback) cannot be in the seal of the
# run it marks: the run may have been sealed before a later turn rolled it
# back (a resumed interrupted run). It is append-only by itself instead:
# once recorded, never changed nor removed.
run_rollback_append_only = pgtrigger.Trigger(
    name="run_rollback_append_only",
    when=pgtrigger.Before,
    operation=pgtrigger.Update | pgtrigger.Delete,
    func=f"""
        IF {_BYPASS} THEN
            RETURN COALESCE(NEW, OLD);
        END IF;
        RAISE EXCEPTION 'the rollback mark of run % is append-only (R-GOV-3)', OLD.run_id {_REFUSE};
    """,
)

MESSAGE_TRIGGERS = [closed_audit_facts, audit_row_delete, sealed_prompt]
RUN_TRIGGERS = [run_delete, sealed_run]
ROLLBACK_TRIGGERS = [run_rollback_append_only]
