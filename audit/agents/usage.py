"""Token usage exactly as the provider billed it (R-MA-11).

Providers report usage while streaming in one of three ways (the *usage
mode* of a configured model):

- ``final``: one report, in a last chunk (OpenAI with
  ``stream_options.include_usage``; the default);
- ``cumulative``: running totals on every chunk (vLLM's continuous usage
  stats): the last report is the bill;
- ``delta``: increments on every chunk: their sum is the bill.

langchain-core's v3 bridge adds the top-level counts of every chunk's
``usage_metadata`` and keeps only the last chunk's details
(``_compat_bridge._accumulate_usage``), which is right for none of the three
when more than one chunk reports. So the chat model folds the reports of one
call itself (:class:`UsageFold`) and hands LangChain exactly one report —
the provider's billed total — in a last chunk, as OpenAI does
(``audit.agents.provider``). message-finish, the final State's AIMessage and
the audit row then all carry the same figures.

Stored usage uses LangChain's ``UsageMetadata`` names: ``input_tokens``,
``output_tokens``, ``total_tokens``, ``input_token_details: {cache_read,
cache_creation}``, ``output_token_details: {reasoning}``. Details are parts
of the totals (OpenAI counts cached and cache-write tokens in
``prompt_tokens`` and reasoning tokens in ``completion_tokens``), never
added to them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, get_args

from langchain_core.messages import BaseMessage
from langchain_core.messages.ai import UsageMetadata, add_usage

from core.config import get_config

UsageMode = Literal["final", "cumulative", "delta"]
USAGE_MODES: tuple[str, ...] = get_args(UsageMode)
DEFAULT_USAGE_MODE: UsageMode = "final"

_STABLE_DETAILS = {
    "input_token_details": ("cache_read", "cache_creation"),
    "output_token_details": ("reasoning",),
}


def usage_mode_for(model_name: str, messages: Sequence[BaseMessage] = ()) -> UsageMode:
    """The usage mode of the configured model ``model_name`` (``provider:name``)
    for one request with ``messages``.

    ``MODEL_USAGE_MODES`` wins; a ``replay:<scenario>`` model not listed there
    takes the ``usage_mode`` of the scenario turn this request plays (the
    turn the replay server picks from the same messages); anything else is
    ``final``. Raises nothing: an unreadable scenario counts as ``final``.
    """
    configured = get_config().MODEL_USAGE_MODES
    if model_name in configured:
        return configured[model_name]
    provider, _, scenario = model_name.partition(":")
    if provider == "replay" and scenario:
        return replay_usage_mode(scenario, messages)
    return DEFAULT_USAGE_MODE


def replay_usage_mode(scenario: str, messages: Sequence[BaseMessage]) -> UsageMode:
    """The ``usage_mode`` of the bundled scenario's turn that ``messages``
    select (number of AI messages after the last human message, as the
    replay server counts them); ``final`` when there is no such turn."""
    from ..replay.scenarios import BUNDLED_DIR, SUBAGENT_SEPARATOR
    from ..replay.server import turn_index

    # ``<scenario>/<subagent>``: that subagent's turns (R-SUB-1).
    scenario, _, subagent = scenario.partition(SUBAGENT_SEPARATOR)
    path = BUNDLED_DIR / f"{scenario}.json"
    try:
        modes = _scenario_modes(path, path.stat().st_mtime_ns, subagent)
    except OSError:
        return DEFAULT_USAGE_MODE
    roles = [{"role": {"human": "user", "ai": "assistant"}.get(m.type, m.type)} for m in messages]
    index = turn_index(roles)
    return modes[index] if index < len(modes) else DEFAULT_USAGE_MODE


@lru_cache(maxsize=256)
def _scenario_modes(path: Path, mtime_ns: int, subagent: str = "") -> tuple[UsageMode, ...]:
    # Read the raw file (not the validated model) so that the worker never
    # fails a run over a scenario the replay server would refuse anyway.
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        turns = (data.get("subagents") or {}).get(subagent) if subagent else data.get("turns")
        turns = turns if isinstance(turns, list) else []
    except (OSError, ValueError, AttributeError):
        return ()
    modes: list[UsageMode] = []
    for turn in turns:
        mode = turn.get("usage_mode") if isinstance(turn, dict) else None
        modes.append(mode if mode in USAGE_MODES else DEFAULT_USAGE_MODE)
    return tuple(modes)


class UsageFold:
    """Folds the usage reports of one streamed model call into the
    provider's billed total, by usage mode.

    ``add(report)`` takes each chunk's ``usage_metadata`` in stream order;
    ``total()`` is the bill (None when the provider reported nothing: usage
    unknown). ``final`` and ``cumulative`` keep the last report (a final
    report is the only one; a running total's last value is the total),
    ``delta`` adds them up, details included.
    """

    def __init__(self, mode: UsageMode):
        if mode not in USAGE_MODES:
            raise ValueError(f"unknown usage mode {mode!r}: use one of {', '.join(USAGE_MODES)}")
        self.mode = mode
        self.reports = 0
        self._total: UsageMetadata | None = None

    def add(self, report: UsageMetadata) -> None:
        self.reports += 1
        if self.mode == "delta" and self._total is not None:
            self._total = add_usage(self._total, report)
        else:
            self._total = report

    def total(self) -> UsageMetadata | None:
        return normalize_usage(self._total) if self._total is not None else None


def normalize_usage(usage: UsageMetadata | dict[str, Any]) -> UsageMetadata:
    """``usage`` under the stable names, as plain ints.

    - ``total_tokens`` missing: ``input_tokens + output_tokens``.
    - Details that langchain-openai names after a service tier
      (``priority_cache_read``, ``flex_reasoning``, …) are stored under the
      stable name (``cache_read``, ``reasoning``); other detail keys are kept.
    - Empty detail objects are dropped; details are never added to totals.
    """
    result: dict[str, Any] = {
        "input_tokens": int(usage.get("input_tokens") or 0),
        "output_tokens": int(usage.get("output_tokens") or 0),
    }
    total = usage.get("total_tokens")
    result["total_tokens"] = int(total) if total is not None else result["input_tokens"] + result["output_tokens"]
    for group, stable in _STABLE_DETAILS.items():
        details: dict[str, int] = {}
        for key, value in (usage.get(group) or {}).items():
            if value is None:
                continue
            name = next((s for s in stable if key.endswith(f"_{s}")), key)
            details[name] = details.get(name, 0) + int(value)
        if details:
            result[group] = details
    return result  # type: ignore[return-value]
