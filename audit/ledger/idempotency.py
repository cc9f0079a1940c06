"""Idempotency keys: scoped per user, shared by submit and resume (R-IDEM-1).

A client sends a ``request_id`` with every turn and every resume. The key is
unique per user (constraint ``run_request_id_user_uniq``), whatever the
operation; another user's equal key is a different key. Each run stores the
fingerprint of the request that created it — kind (``turn``/``resume``),
target (the thread of a turn, the interrupted run of a resume) and input —
so a retry is told apart from a different request under the same key:

- same key, same fingerprint: the same run again (the API answers 200);
- same key, other fingerprint: :class:`~audit.errors.RequestIdReused`
  (409 ``request_id_reused``), nothing changed.

Runs created before fingerprints were stored have an empty
``request_fingerprint``; theirs is derived from the stored thread, resumed
run and input (:func:`run_fingerprint`), which gives the same value.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

from ..errors import RequestIdReused
from ..models import AgentRun


def turn_fingerprint(*, thread_id: uuid.UUID | str, text: str) -> str:
    """Fingerprint (64 hex characters) of a turn: its thread and text."""
    return _digest({"kind": "turn", "target": str(thread_id), "input": {"text": text}})


def resume_fingerprint(*, run_id: uuid.UUID | str, decisions: list[dict[str, Any]]) -> str:
    """Fingerprint (64 hex characters) of a resume: the interrupted run and
    the decisions as the API takes them (``{"type", "args"?, "message"?}``),
    reduced to what each decision does (an ``approve`` ignores args, an
    absent reject message equals an empty one)."""
    return _digest({"kind": "resume", "target": str(run_id), "input": [_api_decision(d) for d in decisions]})


def run_fingerprint(run: AgentRun) -> str:
    """The fingerprint of the request that created ``run``: the stored one,
    or for a run created before fingerprints were stored, the one derived
    from its thread, resumed run and input."""
    if run.request_fingerprint:
        return run.request_fingerprint
    data = run.input or {}
    if run.resumed_from_id is not None:
        return _digest(
            {
                "kind": "resume",
                "target": str(run.resumed_from_id),
                "input": [_graph_decision(d) for d in data.get("decisions") or []],
            }
        )
    return turn_fingerprint(thread_id=run.thread_id, text=str(data.get("text", "")))


def existing_request(*, user, request_id: str, fingerprint: str) -> AgentRun | None:
    """The caller's run created under ``request_id`` by the same request, or
    None when the key is unused (by this user).

    Raises:
        RequestIdReused: the caller used the key for a different request.
    """
    run = AgentRun.objects.filter(user=user, request_id=request_id).first()
    if run is None:
        return None
    if run_fingerprint(run) != fingerprint:
        raise RequestIdReused(
            "request_id was already used for a different request",
            extra={"reason": "request_id_reused", "request_id": request_id},
        )
    return run


def _api_decision(decision: dict[str, Any]) -> dict[str, Any]:
    kind = decision.get("type")
    if kind == "edit":
        return {"type": "edit", "args": decision.get("args")}
    if kind == "reject":
        return {"type": "reject", "message": str(decision.get("message") or "")}
    return {"type": kind}


def _graph_decision(decision: Any) -> dict[str, Any]:
    """The inverse of the API → approval middleware translation in
    :func:`audit.ledger.runs._graph_decisions`."""
    if not isinstance(decision, dict):
        return {"type": None}
    kind = decision.get("type")
    if kind == "edit":
        return {"type": "edit", "args": (decision.get("edited_action") or {}).get("args")}
    if kind == "reject":
        return {"type": "reject", "message": str(decision.get("message") or "")}
    return {"type": kind}


def _digest(value: dict[str, Any]) -> str:
    # ensure_ascii: a lone surrogate in the input still encodes.
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()
