"""The cost of one model call (R-COST-1).

A model row is priced when it closes, from its stored usage (LangChain's
``UsageMetadata`` shape) with the `genai-prices` package: the project's
usage names map to genai-prices' ``Usage`` like this —

================================================  ===========================
stored usage                                      genai-prices ``Usage``
================================================  ===========================
``input_tokens`` (all input, cached included)     ``input_tokens``
``input_token_details.cache_read``                ``cache_read_tokens``
``input_token_details.cache_creation``            ``cache_write_tokens``
``input_token_details.audio``                     ``input_audio_tokens``
``output_tokens`` (all output, reasoning incl.)   ``output_tokens``
``output_token_details.reasoning``                ``output_reasoning_tokens``
``output_token_details.audio``                    ``output_audio_tokens``
================================================  ===========================

Both count the details *inside* the totals, so genai-prices bills each
detail at its own price and the rest of the total at the plain price.

Where the price comes from, first match wins:

1. ``MODEL_PRICES[<configured model name>]`` (USD per million tokens for
   ``input``, ``cached_input``, ``cache_creation``, ``output``,
   ``reasoning``) — source ``MODEL_PRICES``, version ``sha256:<digest of
   the entry>``;
2. ``replay:*`` models: :data:`REPLAY_DEFAULT_PRICES` — source
   ``replay-default``;
3. the genai-prices catalogue for the provider of the configured name
   (``openai:<model>`` → provider ``openai``) and the model the provider reported
   (``metadata.model_name``, else the configured one), at the call's
   timestamp — source ``genai-prices``, version the package version (its
   data ships with the package; no network).

Nothing found, no usage, or usage genai-prices refuses: the cost is
unknown — ``cost_usd`` null, never 0 — and the reason is kept in
``metadata.cost_unknown``. Pricing never raises into a run: any error is
logged and gives unknown.
"""

from __future__ import annotations

import datetime as dt
import decimal
import functools
import hashlib
import json
import logging
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from core.config import ModelPriceConfig, get_config

log = logging.getLogger(__name__)

#: Stored precision of ``cost_usd``: 12 decimal places of a USD.
COST_QUANTUM = Decimal("1e-12")

#: Default prices of ``replay:*`` models, USD per million tokens, so tests
#: and the quick start show real figures without configuration. Every kind
#: has its own price so a test can tell them apart.
REPLAY_DEFAULT_PRICES = ModelPriceConfig(
    input=Decimal("1.00"),
    cached_input=Decimal("0.10"),
    cache_creation=Decimal("1.25"),
    output=Decimal("4.00"),
    reasoning=Decimal("6.00"),
)
REPLAY_PRICES_VERSION = "1"

SOURCE_OVERRIDE = "MODEL_PRICES"
SOURCE_REPLAY = "replay-default"
SOURCE_CATALOGUE = "genai-prices"
SOURCE_UNKNOWN = "unknown"

# stored usage path -> genai-prices usage key
_USAGE_KEYS = (
    (("input_tokens",), "input_tokens"),
    (("output_tokens",), "output_tokens"),
    (("input_token_details", "cache_read"), "cache_read_tokens"),
    (("input_token_details", "cache_creation"), "cache_write_tokens"),
    (("input_token_details", "audio"), "input_audio_tokens"),
    (("output_token_details", "reasoning"), "output_reasoning_tokens"),
    (("output_token_details", "audio"), "output_audio_tokens"),
)


@dataclass(frozen=True)
class Cost:
    """A model call's cost: ``usd`` (Decimal, 12 places) or ``None`` when
    unknown, with ``source``/``version`` of the price, or ``unknown`` (the
    reason: ``usage_unknown``, ``usage_invalid``, ``price_unknown``,
    ``price_error``)."""

    usd: Decimal | None
    source: str = ""
    version: str = ""
    unknown: str = ""


class UnknownCost(Exception):
    """Raised inside this module only; becomes :attr:`Cost.unknown`."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def usage_counts(usage: Any) -> dict[str, int]:
    """Map stored usage to genai-prices usage keys (tokens, ints ≥ 0).

    Raises :class:`UnknownCost` (``usage_unknown``) without usage or without
    both ``input_tokens`` and ``output_tokens``, and (``usage_invalid``) for
    a count that is not a non-negative integer or details that add up to
    more than their total."""
    if not isinstance(usage, dict) or not usage:
        raise UnknownCost("usage_unknown")
    counts: dict[str, int] = {}
    for path, key in _USAGE_KEYS:
        value: Any = usage
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UnknownCost("usage_invalid", f"{'.'.join(path)} = {value!r}")
        counts[key] = value
    if "input_tokens" not in counts or "output_tokens" not in counts:
        raise UnknownCost("usage_unknown", "no input_tokens/output_tokens")
    # Details are parts of their totals; usage saying otherwise is wrong
    # whichever price applies (genai-prices checks priced parts only).
    cached = counts.get("cache_read_tokens", 0) + counts.get("cache_write_tokens", 0)
    if (
        max(cached, counts.get("input_audio_tokens", 0)) > counts["input_tokens"]
        or max(counts.get("output_reasoning_tokens", 0), counts.get("output_audio_tokens", 0)) > counts["output_tokens"]
    ):
        raise UnknownCost("usage_invalid", f"token details exceed their totals: {usage!r}")
    return counts


def price_usage(*, model: str, usage: Any, at: dt.datetime | None, reported_model: str = "") -> Cost:
    """The cost of one call of ``model`` (the configured name, e.g.
    ``openai:gpt-4o-mini`` or ``replay:plain_answer``) with ``usage``
    (stored shape, tokens), priced at ``at`` (the call's time; ``None``:
    now). ``reported_model`` is the model name the provider reported.

    Never raises: an unknown usage or price, or any error of the price
    catalogue, gives ``Cost(usd=None, unknown=<reason>)`` (logged).
    Implements R-COST-1.
    """
    try:
        counts = usage_counts(usage)
        override = get_config().MODEL_PRICES.get(model)
        try:
            if override is not None:
                return _cost(
                    _total(_override_price(override), counts, catalogue=False), SOURCE_OVERRIDE, _digest(override)
                )
            if model.startswith("replay:"):
                total = _total(_override_price(REPLAY_DEFAULT_PRICES), counts, catalogue=False)
                return _cost(total, SOURCE_REPLAY, REPLAY_PRICES_VERSION)
            return _catalogue_cost(model=model, reported_model=reported_model, counts=counts, at=at)
        except ValueError as exc:
            # genai-prices refuses usage that contradicts itself (cache
            # reads above the input total, ...).
            raise UnknownCost("usage_invalid", str(exc)) from None
    except UnknownCost as exc:
        if exc.reason != "usage_unknown":
            log.info("cost of a %s call unknown: %s", model, exc)
        return Cost(usd=None, source=SOURCE_UNKNOWN, unknown=exc.reason)
    except Exception:  # the catalogue must never fail a run
        log.exception("pricing a %s call failed; its cost is unknown", model)
        return Cost(usd=None, source=SOURCE_UNKNOWN, unknown="price_error")


def price_depends_on_time(model: str) -> bool:
    """Whether a call of ``model`` (configured name) may cost differently at
    another time: only a catalogue price can (genai-prices prices change by
    date and time of day); ``MODEL_PRICES`` and the replay defaults never do."""
    return get_config().MODEL_PRICES.get(model) is None and not model.startswith("replay:")


def price_row(row, *, model: str) -> list[str]:
    """Price a closed model row (a ``conversations.Message``) in place:
    sets ``cost_usd``, ``price_source``, ``price_version`` and, when the
    cost is unknown for a reason other than missing usage,
    ``metadata.cost_unknown``. The call's time is ``started_at``, else
    ``finished_at``. Returns the field names to save. Never raises."""
    cost = price_usage(
        model=model,
        usage=row.usage,
        at=row.started_at or row.finished_at,
        reported_model=str((row.metadata or {}).get("model_name") or ""),
    )
    row.cost_usd, row.price_source, row.price_version = cost.usd, cost.source, cost.version
    fields = ["cost_usd", "price_source", "price_version"]
    if cost.unknown:
        row.metadata = {**(row.metadata or {}), "cost_unknown": cost.unknown}
        fields.append("metadata")
    return fields


def price_unpriced_rows(run) -> None:
    """Price the closed model rows of ``run`` that carry usage but were
    never priced: rows the terminal reconcile completed or inserted from
    the final State. Called in the terminal transaction (R-COST-1)."""
    from conversations.models import Message

    rows = (
        Message.objects.model_calls()
        .filter(run=run, price_source="", usage__isnull=False)
        .exclude(execution_status=Message.ExecutionStatus.RUNNING)
    )
    for row in rows:
        fields = price_row(row, model=run.model)
        row.save(update_fields=[*dict.fromkeys(fields), "updated_at"])


def warm_up() -> None:
    """Import the price catalogue now (it is a large module)."""
    try:
        _catalogue()
    except Exception:  # pragma: no cover - never stop a worker over prices
        log.exception("loading the genai-prices catalogue failed")


# --------------------------------------------------------------------------


def _cost(total: Decimal, source: str, version: str) -> Cost:
    return Cost(usd=Decimal(total).quantize(COST_QUANTUM), source=source, version=version)


def _catalogue_cost(*, model: str, reported_model: str, counts: dict[str, int], at: dt.datetime | None) -> Cost:
    genai_prices = _catalogue()
    provider_id, _, name = model.partition(":")
    if not name:
        raise UnknownCost("price_unknown", f"no provider in the model name {model!r}")
    at = at or dt.datetime.now(dt.UTC)
    snapshot = genai_prices.data_snapshot.get_snapshot()
    for ref in dict.fromkeys(r for r in (reported_model, name) if r):
        # The lookup genai-prices' calc_price makes (cached by the catalogue).
        try:
            _, info = snapshot.find_provider_model(ref, None, provider_id, None)
        except LookupError:
            continue
        return _cost(_total(info.get_prices(at), counts), SOURCE_CATALOGUE, genai_prices.__version__)
    raise UnknownCost("price_unknown", f"{provider_id} has no price for {reported_model or name!r}")


def _total(model_price, counts: dict[str, int], *, catalogue: bool = True) -> Decimal:
    """USD of ``counts`` (genai-prices usage keys) at ``model_price`` (a
    genai-prices ``ModelPrice``): by its :class:`LinearPrice` where it has
    one and the counts lie where that form holds, else by its own
    ``calc_price``.

    Raises ``ValueError`` where genai-prices refuses the usage."""
    linear = linear_price(model_price, catalogue=catalogue)
    if linear is not None and linear.holds_for(counts):
        return linear.total(counts)
    return model_price.calc_price(_usage(counts, catalogue=catalogue))["total_price"]


#: Token counts of the probes that derive a :class:`LinearPrice`.
_PROBE_TOKENS = 1_000_000
_INPUT_PARTS = ("cache_read_tokens", "cache_write_tokens", "input_audio_tokens")
_OUTPUT_PARTS = ("output_reasoning_tokens", "output_audio_tokens")
#: Where a :class:`LinearPrice` is used, genai-prices' own arithmetic (28
#: significant digits) is exact, so both give the same figure: prices of at
#: most 12 decimal places below 10**6 USD a unit, and calls of fewer than
#: 10**10 tokens of each kind (every term then has at most 28 digits).
#: Other prices and counts are priced by ``calc_price`` itself.
_MAX_PRICE_DECIMALS = 12
_MAX_PRICE = Decimal(10**6)
_MAX_COUNT = 10**10
#: The linear form's own sums: exact for every count and price above.
_EXACT = decimal.Context(prec=60)


@dataclass(frozen=True)
class LinearPrice:
    """A genai-prices price as what it is for token usage without tiers: a
    fixed part (per request) plus, for each usage key, its count times a
    price per token — derived from the price's own ``calc_price``
    (:func:`linear_price`), so that genai-prices stays the source of every
    figure and unit rule, and a call costs a few multiplications instead of
    its unit validation and decomposition (issue 12: a model row's close
    with its cost within 10 % of the close without).

    It holds (:meth:`holds_for`) where the input details (cache reads and
    writes, audio) fit in the input total and the output details
    (reasoning, audio) in the output total, the only usage genai-prices
    decomposes without refusing it; elsewhere the caller asks ``calc_price``.
    """

    fixed: Decimal
    per_token: tuple[tuple[str, Decimal], ...]

    @staticmethod
    def holds_for(counts: dict[str, int]) -> bool:
        return (
            all(count < _MAX_COUNT for count in counts.values())
            and sum(counts.get(k, 0) for k in _INPUT_PARTS) <= counts.get("input_tokens", 0)
            and sum(counts.get(k, 0) for k in _OUTPUT_PARTS) <= counts.get("output_tokens", 0)
        )

    def total(self, counts: dict[str, int]) -> Decimal:
        """USD of ``counts``, exact (see :data:`_MAX_COUNT`)."""
        total = self.fixed
        for key, price in self.per_token:
            count = counts.get(key)
            if count:
                total = _EXACT.fma(count, price, total)
        return total


# id(ModelPrice) -> (the ModelPrice, its linear form or None): the
# catalogue's prices and ours live as long as the process.
_linear_prices: dict[tuple[int, bool], tuple[Any, LinearPrice | None]] = {}


def linear_price(model_price, *, catalogue: bool = True) -> LinearPrice | None:
    """The :class:`LinearPrice` of a genai-prices ``ModelPrice``, or None
    when it has none: tiered prices (the rate depends on the input total),
    or a price whose figures the linear form does not reproduce (checked on
    a mixed usage). Derived once per price by asking its ``calc_price`` the
    price of one base usage and of that usage plus :data:`_PROBE_TOKENS` of
    each kind; ``catalogue`` says which usage shape those calls get
    (:func:`_usage`). Never raises."""
    key = (id(model_price), catalogue)
    known = _linear_prices.get(key)
    if known is not None and known[0] is model_price:
        return known[1]
    try:
        linear = _derive_linear(model_price, catalogue=catalogue)
    except Exception:  # noqa: BLE001 - a price genai-prices cannot probe: use calc_price
        log.debug("no linear form for the price %r; each call uses calc_price", model_price)
        linear = None
    _linear_prices[key] = (model_price, linear)
    return linear


def _derive_linear(model_price, *, catalogue: bool) -> LinearPrice | None:
    values = [value for value in vars(model_price).values() if value is not None]
    if not all(_exact_price(value) for value in values):
        return None  # tiered, or beyond where calc_price is exact

    def total(counts: dict[str, int]) -> Decimal:
        return Decimal(model_price.calc_price(_usage(counts, catalogue=catalogue))["total_price"])

    m = _PROBE_TOKENS
    base = {"input_tokens": m, "output_tokens": m}
    at_base = total(base)
    per_token = tuple(
        (key, _EXACT.divide(_EXACT.subtract(total({**base, key: base.get(key, 0) + m}), at_base), m))
        for _, key in _USAGE_KEYS
    )
    prices = dict(per_token)
    linear = LinearPrice(
        fixed=_EXACT.subtract(at_base, _EXACT.multiply(m, _EXACT.add(prices["input_tokens"], prices["output_tokens"]))),
        per_token=tuple((key, price) for key, price in per_token if price),
    )
    mixed = {
        "input_tokens": 7 * m + 3,
        "output_tokens": 5 * m + 1,
        "cache_read_tokens": 2 * m + 1,
        "cache_write_tokens": m,
        "input_audio_tokens": m,
        "output_reasoning_tokens": 2 * m,
        "output_audio_tokens": m,
    }
    return linear if linear.total(mixed) == total(mixed) else None


def _exact_price(value: Any) -> bool:
    """A plain price (not tiered) within :data:`_MAX_PRICE_DECIMALS` and
    :data:`_MAX_PRICE`."""
    return (
        isinstance(value, Decimal)
        and value.is_finite()
        and value.normalize().as_tuple().exponent >= -_MAX_PRICE_DECIMALS
        and abs(value) < _MAX_PRICE
    )


@functools.cache
def _catalogue():
    import genai_prices
    import genai_prices.data  # noqa: F401  (the catalogue itself)

    return genai_prices


def _usage(counts: dict[str, int], *, catalogue: bool = True):
    """A genai-prices ``Usage`` with the reported counts and explicit zeros
    for the token kinds we map but the call did not report and, for a
    catalogue price, for every non-token unit (searches, seconds, pages…),
    which we never report. genai-prices would infer exactly these zeros —
    nothing more specific is reported — and inferring is the slow part of
    its calculation. A price of our own (overrides, replay) prices token
    kinds only, so it needs no non-token zeros."""
    from genai_prices import Usage

    mapped = {key: counts.get(key, 0) for _, key in _USAGE_KEYS}
    return Usage(**_non_token_zeros(), **mapped) if catalogue else Usage(**mapped)


@functools.cache
def _non_token_zeros() -> dict[str, int]:
    from genai_prices.data_units import unit_data

    return {
        key: 0
        for key, unit in unit_data.items()
        if key != "requests" and (unit.get("dimensions") or {}).get("family") != "tokens"
    }


@functools.cache
def _override_price_cached(price: ModelPriceConfig):
    from genai_prices.types import ModelPrice

    kinds = {
        "input_mtok": price.input,
        "cache_read_mtok": price.cached_input,
        "cache_write_mtok": price.cache_creation,
        "output_mtok": price.output,
        "output_reasoning_mtok": price.reasoning,
    }
    return ModelPrice(**{key: value for key, value in kinds.items() if value is not None})


def _override_price(price: ModelPriceConfig):
    """genai-prices' own ``ModelPrice`` for a configured price, so that
    overrides are computed by the same arithmetic as the catalogue."""
    return _override_price_cached(price)


def _digest(price: ModelPriceConfig) -> str:
    canonical = json.dumps({k: str(v) for k, v in price.model_dump().items() if v is not None}, sort_keys=True)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()[:16]
