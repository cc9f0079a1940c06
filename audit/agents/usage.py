"""Token usage exactly as the provider billed it (R-MA-11), or unknown when
the reports prove no bill (R-MA-12).

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

Reports that contradict the mode (several under ``final``, a running total
that decreases under ``cumulative``) prove no bill: the call's usage is
unknown and its ``usage_cause`` is ``usage_mode_conflict`` (R-MA-12).

Stored usage uses LangChain's ``UsageMetadata`` names: ``input_tokens``,
``output_tokens``, ``total_tokens``, ``input_token_details: {cache_read,
cache_creation}``, ``output_token_details: {reasoning}``. Details are parts
of the totals (OpenAI counts cached and cache-write tokens in
``prompt_tokens`` and reasoning tokens in ``completion_tokens``), never
added to them.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from langchain_core.messages.ai import UsageMetadata, add_usage

from core.config import get_config

UsageMode = Literal["final", "cumulative", "delta"]
USAGE_MODES: tuple[str, ...] = get_args(UsageMode)
DEFAULT_USAGE_MODE: UsageMode = "final"

_STABLE_DETAILS = {
    "input_token_details": ("cache_read", "cache_creation"),
    "output_token_details": ("reasoning",),
}


def usage_mode_for(model_name: str, served_mode: str | None = None) -> UsageMode:
    """The usage mode of one call of the configured model ``model_name``
    (``provider:name``).

    ``MODEL_USAGE_MODES`` wins; a ``replay:<scenario>`` model not listed there
    takes ``served_mode``, the mode the replay server declared for the turn
    it plays (its ``x-yuxi-usage-mode`` response header, whatever scenario
    directory it serves, R-MA-12); anything else is ``final``, as is an
    absent or unknown ``served_mode``. Raises nothing.
    """
    configured = get_config().MODEL_USAGE_MODES
    if model_name in configured:
        return configured[model_name]
    provider, _, scenario = model_name.partition(":")
    if provider == "replay" and scenario and served_mode in USAGE_MODES:
        return served_mode  # type: ignore[return-value]
    return DEFAULT_USAGE_MODE


USAGE_MODE_CONFLICT = "usage_mode_conflict"
"""The ``usage_cause`` of a call whose reports contradict its usage mode
(R-MA-12)."""


class UsageFold:
    """Folds the usage reports of one streamed model call into the
    provider's billed total, by usage mode.

    ``add(report)`` takes each chunk's ``usage_metadata`` in stream order;
    ``total()`` is the bill (None when the provider reported nothing: usage
    unknown). ``final`` and ``cumulative`` keep the last report (a final
    report is the only one; a running total's last value is the total),
    ``delta`` adds them up, details included.

    Reports that contradict the mode prove no bill (R-MA-12): more than one
    report under ``final``, or a figure (a total, or a detail both reports
    give) that decreases from one report to the next under ``cumulative``.
    Then ``total()`` is None and ``cause`` is :data:`USAGE_MODE_CONFLICT`
    (else None): the usage is stored unknown, never a number the provider
    did not bill.
    """

    def __init__(self, mode: UsageMode):
        if mode not in USAGE_MODES:
            raise ValueError(f"unknown usage mode {mode!r}: use one of {', '.join(USAGE_MODES)}")
        self.mode = mode
        self.reports = 0
        self.cause: str | None = None
        self._total: UsageMetadata | None = None

    def add(self, report: UsageMetadata) -> None:
        self.reports += 1
        if self.cause is not None:
            return
        if self._contradicts(report):
            self.cause, self._total = USAGE_MODE_CONFLICT, None
        elif self.mode == "delta" and self._total is not None:
            self._total = add_usage(self._total, report)
        else:
            self._total = report

    def _contradicts(self, report: UsageMetadata) -> bool:
        if self.mode == "final":
            return self.reports > 1
        if self.mode == "cumulative" and self._total is not None:
            before, after = _figures(self._total), _figures(report)
            return any(after[name] < value for name, value in before.items() if name in after)
        return False

    def total(self) -> UsageMetadata | None:
        return normalize_usage(self._total) if self._total is not None else None


def _figures(usage: UsageMetadata) -> dict[str, int]:
    """``usage`` normalized and flat: ``{"input_tokens": n, …,
    "input_token_details.cache_read": n, …}``."""
    normal: dict[str, Any] = dict(normalize_usage(usage))
    flat = {name: normal[name] for name in ("input_tokens", "output_tokens", "total_tokens")}
    for group in _STABLE_DETAILS:
        flat.update((f"{group}.{key}", value) for key, value in (normal.get(group) or {}).items())
    return flat


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
