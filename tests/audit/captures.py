"""Reading the recorded LangGraph v3 streams in ``tests/fixtures/captures``
(copies of the protocol notes' captures; provenance in their README) back
into the live objects the worker sees (tuples, LangChain messages,
Interrupts), grouped into runs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from langchain_core import messages as lc_messages
from langgraph.types import Command, Interrupt

CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "captures"

_MESSAGE_CLASSES = {
    name: getattr(lc_messages, name)
    for name in ("AIMessage", "AIMessageChunk", "HumanMessage", "ToolMessage", "SystemMessage")
}


def decode(value: Any) -> Any:
    """Undo the capture encoder: ``{"__tuple__": [...]}`` is a tuple,
    ``{"__pyclass__": "AIMessage", ...}`` the message object (and the same
    for ``Interrupt`` and ``Command``)."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {"__tuple__"}:
        return tuple(decode(v) for v in value["__tuple__"])
    cls = value.get("__pyclass__")
    fields = {k: decode(v) for k, v in value.items() if k != "__pyclass__"}
    if cls in _MESSAGE_CLASSES:
        return _MESSAGE_CLASSES[cls](**fields)
    if cls == "Interrupt":
        return Interrupt(value=fields.get("value"), id=fields.get("id"))
    if cls == "Command":
        # What a tool returning a state update (deepagents' task) finishes with.
        return Command(
            graph=fields.get("graph"),
            update=fields.get("update"),
            resume=fields.get("resume"),
            goto=fields.get("goto") or (),
        )
    return fields


@dataclass
class CapturedRun:
    """One ``stream_events`` call of a capture: its raw events in order and
    whether the iteration raised (the run failed)."""

    label: str
    events: list[dict] = field(default_factory=list)
    raised: str | None = None

    def messages_events(self) -> list[dict]:
        return [e for e in self.events if e["method"] == "messages"]

    def starts(self) -> list[dict]:
        return [
            e
            for e in self.messages_events()
            if isinstance(e["params"]["data"][0], dict) and e["params"]["data"][0].get("event") == "message-start"
        ]

    def finishes(self) -> list[dict]:
        return [
            e
            for e in self.messages_events()
            if isinstance(e["params"]["data"][0], dict) and e["params"]["data"][0].get("event") == "message-finish"
        ]


def load_capture(name: str) -> list[CapturedRun]:
    """The runs of ``capture_<name>.jsonl`` in file order (captures d, d2 and
    f hold several runs labelled by ``_run``)."""
    runs: list[CapturedRun] = []
    for line in (CAPTURES / f"capture_{name}.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        raw = json.loads(line)
        if "_note" in raw:
            note = raw["_note"]
            if isinstance(note, dict) and "iteration_raised" in note and runs:
                runs[-1].raised = note["iteration_raised"]
            continue
        label = raw.pop("_run", "")
        if not runs or runs[-1].label != label or (raw.get("seq") == 1 and runs[-1].events):
            runs.append(CapturedRun(label))
        runs[-1].events.append(decode(raw))
    return runs


def capture_names() -> list[str]:
    return sorted(p.name[len("capture_") : -len(".jsonl")] for p in CAPTURES.glob("capture_*.jsonl"))
