"""What a thread may name: the built-in agents and the chat models (SPEC §5).

A new thread is checked against this catalogue (``conversations.services``),
the admin offers its names as choices, and the metrics bound their model
label by it (``ops.metrics``); the agents (``audit.agents``) and the replay
model server (``audit.replay``) build what it names.

Foundation: it imports only the configuration and the product's errors, so
every layer above may ask it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from core.config import get_config
from core.errors import InvalidInput

#: The built-in agents (``audit.agents.assistant``, ``audit.agents.researcher``).
AGENTS = ("assistant", "researcher")

#: The replay scenarios shipped with the product: ``replay:<file stem>``.
BUNDLED_SCENARIO_DIR = Path(__file__).resolve().parent / "replay" / "scenarios"


class UnknownAgent(InvalidInput):
    code = "unknown_agent"


class UnknownModel(InvalidInput):
    code = "unknown_model"


def validate_agent_id(agent_id: str) -> str:
    """Return ``agent_id`` if it is a built-in agent; raises
    :class:`UnknownAgent` (422, ``available`` lists the agents)."""
    if agent_id not in AGENTS:
        raise UnknownAgent(f"unknown agent {agent_id!r}", extra={"available": list(AGENTS)})
    return agent_id


def bundled_scenario_names() -> list[str]:
    """Names of the scenarios shipped in ``audit/replay/scenarios/``, sorted
    (file stems; the files are not validated here)."""
    return sorted(path.stem for path in BUNDLED_SCENARIO_DIR.glob("*.json"))


def available_models() -> list[str]:
    """Model names a thread may use: every bundled replay scenario plus the
    configured ``MODELS`` list."""
    names = [f"replay:{name}" for name in bundled_scenario_names()]
    names += [m for m in get_config().MODELS if m not in names]
    return names


def chat_models() -> list[dict[str, str]]:
    """The models the chat page's select offers (R-UI-1), as ``[{"name",
    "description"}]``: the bundled scenarios marked ``"chat": true`` (those
    meant for a person to try; the fault and load scenarios stay out), then
    the configured ``MODELS`` (description ``""``). ``DEFAULT_MODEL`` is
    always offered, first if nothing else names it. A subset of
    :func:`available_models`, which the API still accepts in full.

    Reads the scenario files without validating them (this is the
    foundation layer; the replay server validates them,
    :mod:`audit.replay.scenarios`): a file that is not a JSON object is
    left out."""
    config = get_config()
    models = [dict(model) for model in _chat_scenarios()]
    names = {model["name"] for model in models}
    for name in config.MODELS:
        if name not in names:
            models.append({"name": name, "description": ""})
            names.add(name)
    if config.DEFAULT_MODEL not in names:
        models.insert(0, {"name": config.DEFAULT_MODEL, "description": ""})
    return models


@functools.cache
def _chat_scenarios() -> tuple[dict[str, str], ...]:
    """The bundled scenarios marked ``"chat": true``, read once per process
    (the files ship with the code): ``({"name", "description"}, ...)``."""
    found = []
    for path in sorted(BUNDLED_SCENARIO_DIR.glob("*.json")):
        try:
            scenario = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(scenario, dict) and scenario.get("chat") is True:
            description = scenario.get("description")
            found.append(
                {"name": f"replay:{path.stem}", "description": description if isinstance(description, str) else ""}
            )
    return tuple(found)


def validate_model_name(name: str) -> str:
    """Return ``name`` if it is available; raises :class:`UnknownModel` (422,
    ``available`` lists the names)."""
    if name not in available_models():
        raise UnknownModel(f"unknown model {name!r}", extra={"available": available_models()})
    return name
