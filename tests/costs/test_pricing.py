"""Price of one model call (R-COST-1): every token kind against the prices
genai-prices itself carries for real models, the call's timestamp,
overrides, replay defaults and every way a cost becomes unknown. The
package ships its data: no network."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import genai_prices
import pytest
from genai_prices import Usage, calc_price

from core.config import ModelPriceConfig, get_config
from costs.pricing import REPLAY_DEFAULT_PRICES, price_usage

M = Decimal(1_000_000)
AT = dt.datetime(2026, 1, 15, 12, 0, tzinfo=dt.UTC)


def usage(inp, out, *, cache_read=None, cache_creation=None, reasoning=None):
    """Stored usage in LangChain's UsageMetadata shape."""
    stored = {"input_tokens": inp, "output_tokens": out, "total_tokens": inp + out}
    details = {k: v for k, v in (("cache_read", cache_read), ("cache_creation", cache_creation)) if v is not None}
    if details:
        stored["input_token_details"] = details
    if reasoning is not None:
        stored["output_token_details"] = {"reasoning": reasoning}
    return stored


def catalogue_price(provider: str, model: str, at=AT):
    """The per-MTok prices genai-prices reports for a model at ``at``."""
    return calc_price(Usage(input_tokens=0, output_tokens=0), model, provider_id=provider, genai_request_timestamp=at)


@pytest.mark.parametrize(
    ("provider", "model"),
    [("openai", "gpt-4o-mini"), ("openai", "gpt-4.1"), ("anthropic", "claude-3-5-haiku-latest")],
)
def test_each_token_kind_is_billed_at_its_catalogue_price_R_COST_1(provider, model):
    prices = catalogue_price(provider, model).model_price
    name = f"{provider}:{model}"

    # Plain input and output.
    cost = price_usage(model=name, usage=usage(1000, 500), at=AT)
    assert cost.usd == (1000 * prices.input_mtok + 500 * prices.output_mtok) / M
    assert (cost.source, cost.version) == ("genai-prices", genai_prices.__version__)

    # Cache reads are part of input_tokens and billed at the cache-read price.
    cost = price_usage(model=name, usage=usage(1000, 500, cache_read=400), at=AT)
    assert cost.usd == (600 * prices.input_mtok + 400 * prices.cache_read_mtok + 500 * prices.output_mtok) / M

    # Cache creation: its own price where the model has one, else input.
    write = prices.cache_write_mtok if prices.cache_write_mtok is not None else prices.input_mtok
    cost = price_usage(model=name, usage=usage(1000, 500, cache_creation=300), at=AT)
    assert cost.usd == (700 * prices.input_mtok + 300 * write + 500 * prices.output_mtok) / M

    # Reasoning is part of output_tokens; these models bill it as output.
    assert prices.output_reasoning_mtok is None
    cost = price_usage(model=name, usage=usage(1000, 500, reasoning=300), at=AT)
    assert cost.usd == (1000 * prices.input_mtok + 500 * prices.output_mtok) / M

    # And the same figure as genai-prices' own calc_price on its own Usage.
    everything = usage(2000, 900, cache_read=500, cache_creation=200, reasoning=100)
    own = calc_price(
        Usage(
            input_tokens=2000,
            output_tokens=900,
            cache_read_tokens=500,
            cache_write_tokens=200,
            output_reasoning_tokens=100,
        ),
        model,
        provider_id=provider,
        genai_request_timestamp=AT,
    )
    assert price_usage(model=name, usage=everything, at=AT).usd == own.total_price


def test_the_reported_model_name_is_priced_and_the_call_time_picks_the_price_R_COST_1():
    # o3 cost $10/$40 per MTok before 2025-06-10 and $2/$8 after (catalogue).
    before, after = dt.datetime(2025, 5, 1, tzinfo=dt.UTC), dt.datetime(2025, 7, 1, tzinfo=dt.UTC)
    assert catalogue_price("openai", "o3", before).model_price.input_mtok == Decimal("10")
    assert catalogue_price("openai", "o3", after).model_price.input_mtok == Decimal("2")
    stored = usage(1_000_000, 0)
    assert price_usage(model="openai:o3", usage=stored, at=before).usd == Decimal("10")
    assert price_usage(model="openai:o3", usage=stored, at=after).usd == Decimal("2")
    # The provider's dated name is matched by the catalogue.
    dated = price_usage(
        model="openai:gpt-4o-mini", usage=usage(1000, 0), at=AT, reported_model="gpt-4o-mini-2024-07-18"
    )
    assert dated.usd == 1000 * catalogue_price("openai", "gpt-4o-mini").model_price.input_mtok / M


def test_replay_models_have_documented_non_zero_default_prices_for_each_kind_R_COST_1():
    p = REPLAY_DEFAULT_PRICES
    assert all(v > 0 for v in (p.input, p.cached_input, p.cache_creation, p.output, p.reasoning))
    cost = price_usage(
        model="replay:plain_answer",
        usage=usage(1000, 500, cache_read=200, cache_creation=100, reasoning=50),
        at=AT,
    )
    expected = (700 * p.input + 200 * p.cached_input + 100 * p.cache_creation + 450 * p.output + 50 * p.reasoning) / M
    assert cost.usd == expected and cost.usd > 0
    assert cost.source == "replay-default"


def test_model_prices_override_catalogue_and_replay_defaults_R_COST_1(monkeypatch):
    monkeypatch.setattr(
        get_config(),
        "MODEL_PRICES",
        {
            "openai:gpt-4o-mini": ModelPriceConfig(input=Decimal("0.5"), output=Decimal("1.5")),
            "openai:my-llama": ModelPriceConfig(
                input=Decimal("0.2"),
                cached_input=Decimal("0.02"),
                cache_creation=Decimal("0.3"),
                output=Decimal("0.6"),
                reasoning=Decimal("0.9"),
            ),
            "replay:plain_answer": ModelPriceConfig(input=Decimal("3"), output=Decimal("7")),
        },
    )
    negotiated = price_usage(model="openai:gpt-4o-mini", usage=usage(1000, 1000, cache_read=500), at=AT)
    # Without a cached_input price, cache reads cost the input price.
    assert negotiated.usd == (1000 * Decimal("0.5") + 1000 * Decimal("1.5")) / M
    assert negotiated.source == "MODEL_PRICES" and negotiated.version.startswith("sha256:")

    self_hosted = price_usage(
        model="openai:my-llama", usage=usage(1000, 1000, cache_read=100, cache_creation=200, reasoning=300), at=AT
    )
    assert (
        self_hosted.usd
        == (
            700 * Decimal("0.2")
            + 100 * Decimal("0.02")
            + 200 * Decimal("0.3")
            + 700 * Decimal("0.6")
            + 300 * Decimal("0.9")
        )
        / M
    )
    replay = price_usage(model="replay:plain_answer", usage=usage(10, 10), at=AT)
    assert replay.usd == (10 * 3 + 10 * 7) / M and replay.source == "MODEL_PRICES"


@pytest.mark.parametrize("kind", ["input", "cached_input", "cache_creation", "output", "reasoning"])
def test_the_price_version_changes_with_the_price_of_each_kind_R_COST_1(monkeypatch, kind):
    """Issue 35: a version digest that left the reasoning price out
    survived the suite. Rows priced under two tables that differ in one
    kind's price must not claim the same price version."""
    prices = {"input": "0.2", "cached_input": "0.02", "cache_creation": "0.3", "output": "0.6", "reasoning": "0.9"}
    table = ModelPriceConfig(**{k: Decimal(v) for k, v in prices.items()})
    changed = table.model_copy(update={kind: getattr(table, kind) + Decimal("0.01")})
    monkeypatch.setattr(get_config(), "MODEL_PRICES", {"openai:a": table, "openai:b": changed})
    stored = usage(1000, 1000, cache_read=100, cache_creation=200, reasoning=300)
    a, b = (price_usage(model=m, usage=stored, at=AT) for m in ("openai:a", "openai:b"))
    assert a.source == b.source == "MODEL_PRICES" and a.usd != b.usd
    assert a.version != b.version


@pytest.mark.parametrize(
    ("model", "stored", "reason"),
    [
        ("replay:plain_answer", None, "usage_unknown"),
        ("replay:plain_answer", {}, "usage_unknown"),
        ("replay:plain_answer", {"total_tokens": 10}, "usage_unknown"),
        ("replay:plain_answer", {"input_tokens": 10}, "usage_unknown"),
        ("replay:plain_answer", {"input_tokens": -1, "output_tokens": 2}, "usage_invalid"),
        ("replay:plain_answer", {"input_tokens": "10", "output_tokens": 2}, "usage_invalid"),
        ("replay:plain_answer", {"input_tokens": True, "output_tokens": 2}, "usage_invalid"),
        ("replay:plain_answer", {"input_tokens": 1.5, "output_tokens": 2}, "usage_invalid"),
        ("replay:plain_answer", usage(10, 5, cache_read=20), "usage_invalid"),
        ("openai:gpt-4o-mini", usage(10, 5, reasoning=50), "usage_invalid"),
        ("openai:no-such-model-anywhere", usage(10, 5), "price_unknown"),
        ("selfhosted:llama-3", usage(10, 5), "price_unknown"),
        ("nameless", usage(10, 5), "price_unknown"),
    ],
)
def test_unknown_usage_or_price_is_unknown_never_zero_R_COST_1(model, stored, reason):
    cost = price_usage(model=model, usage=stored, at=AT)
    assert cost.usd is None
    assert cost.unknown == reason
    assert cost.source == "unknown"


def test_zero_usage_costs_zero_not_unknown_R_COST_1():
    cost = price_usage(model="openai:gpt-4o-mini", usage=usage(0, 0), at=AT)
    assert cost.usd == 0 and cost.unknown == ""


def _catalogue_prices(at=AT):
    """Every price of the bundled catalogue at ``at``: ``(provider, model, ModelPrice)``."""
    snapshot = genai_prices.data_snapshot.get_snapshot()
    for provider in snapshot.providers:
        for model in provider.models:
            yield provider.id, model.id, model.get_prices(at)


def _counts_within(rng, *, audio: bool) -> dict[str, int]:
    """genai-prices usage keys where the details fit in their totals."""
    inp, out = rng.randint(0, 3_000_000), rng.randint(0, 300_000)
    cache_read = rng.randint(0, inp)
    cache_write = rng.randint(0, inp - cache_read)
    input_audio = rng.randint(0, inp - cache_read - cache_write) if audio else 0
    reasoning = rng.randint(0, out)
    output_audio = rng.randint(0, out - reasoning) if audio else 0
    return {
        "input_tokens": inp,
        "output_tokens": out,
        "cache_read_tokens": cache_read,
        "cache_write_tokens": cache_write,
        "input_audio_tokens": input_audio,
        "output_reasoning_tokens": reasoning,
        "output_audio_tokens": output_audio,
    }


def test_the_linear_form_of_every_catalogue_price_gives_calc_prices_own_figures_R_COST_1():
    """A call is priced by the price's linear form (a fixed part plus a
    price per token of each kind, derived from genai-prices' own
    calc_price) instead of calc_price's validation and decomposition on
    every call. For every price of the catalogue that has one, on random
    usage where the details fit in their totals, it must give exactly the
    figure calc_price gives; prices it cannot reproduce have none."""
    import random

    from costs.pricing import _usage, linear_price

    rng = random.Random(11)
    compared = without = 0
    for provider, model, price in _catalogue_prices():
        linear = linear_price(price)
        if linear is None:
            without += 1
            continue
        for i in range(4):
            counts = _counts_within(rng, audio=i % 2 == 1)
            assert linear.holds_for(counts)
            assert linear.total(counts) == Decimal(price.calc_price(_usage(counts))["total_price"]), (
                provider,
                model,
                counts,
            )
            compared += 1
    assert compared > 1000 and without < compared / 4, (compared, without)


@pytest.mark.parametrize(
    "config",
    [
        REPLAY_DEFAULT_PRICES,
        ModelPriceConfig(input=Decimal("3.17"), output=Decimal("11.9")),
        ModelPriceConfig(
            input=Decimal("0.003"),
            cached_input=Decimal("0.0007"),
            cache_creation=Decimal("1.001"),
            output=Decimal("0.011"),
            reasoning=Decimal("123.456789"),
        ),
    ],
)
def test_the_linear_form_of_a_configured_price_gives_calc_prices_own_figures_R_COST_1(config):
    import random

    from costs.pricing import _override_price, _usage, linear_price

    price = _override_price(config)
    linear = linear_price(price, catalogue=False)
    assert linear is not None
    rng = random.Random(5)
    for i in range(300):
        counts = _counts_within(rng, audio=i % 3 == 0)
        assert linear.total(counts) == Decimal(price.calc_price(_usage(counts, catalogue=False))["total_price"])


def test_tiered_prices_and_usage_outside_the_linear_form_are_priced_by_calc_price_R_COST_1():
    """A tiered price (the rate of every token depends on the input total)
    has no linear form; usage whose details exceed their totals is not
    where the form holds. Both are priced exactly as genai-prices' own
    calc_price prices them (or refused as it refuses them)."""
    from genai_prices.types import TieredPrices

    from costs.pricing import LinearPrice, linear_price

    tiered = next(
        (provider, model, price)
        for provider, model, price in _catalogue_prices()
        if any(isinstance(v, TieredPrices) for v in vars(price).values()) and provider in ("google", "anthropic")
    )
    provider, model, price = tiered
    assert linear_price(price) is None
    for inp in (1_000, 150_000, 250_000, 1_000_000):
        stored = usage(inp, 2_000, cache_read=inp // 4)
        own = calc_price(
            Usage(input_tokens=inp, output_tokens=2_000, cache_read_tokens=inp // 4),
            model,
            provider_id=provider,
            genai_request_timestamp=AT,
        )
        assert price_usage(model=f"{provider}:{model}", usage=stored, at=AT).usd == own.total_price.quantize(
            Decimal("1e-12")
        )

    # Cache reads and audio that overlap (each within the input total, not
    # both): outside the form, priced or refused as calc_price does.
    over = {"input_tokens": 100, "output_tokens": 10, "cache_read_tokens": 80, "input_audio_tokens": 80}
    assert not LinearPrice.holds_for(over)
    stored = {
        "input_tokens": 100,
        "output_tokens": 10,
        "total_tokens": 110,
        "input_token_details": {"cache_read": 80, "audio": 80},
    }
    for provider, model in (("openai", "gpt-4o-mini"), ("openai", "gpt-4o-audio-preview")):
        try:
            expected = calc_price(
                Usage(input_tokens=100, output_tokens=10, cache_read_tokens=80, input_audio_tokens=80),
                model,
                provider_id=provider,
                genai_request_timestamp=AT,
            ).total_price.quantize(Decimal("1e-12"))
        except ValueError:
            expected = None
        cost = price_usage(model=f"{provider}:{model}", usage=stored, at=AT)
        assert cost.usd == expected, (model, cost)
        if expected is None:
            assert cost.unknown == "usage_invalid"


@pytest.mark.parametrize(
    ("prices", "stored"),
    [
        # Kinds 1e30 apart: at 28 digits the probes lose the cheap one.
        ({"input": "1E-16", "output": "100000000000000"}, {"input_tokens": 10**22, "output_tokens": 0}),
        # Many significant digits, zero usage: no negative zero.
        (
            {
                "input": "0.09458660099053458674049135500",
                "output": "89.539282717114330560734",
                "cached_input": "0.04297027272419",
                "cache_creation": "13.84415055440996949",
                "reasoning": "0.0004406342149952856023239137687",
            },
            {"input_tokens": 0, "output_tokens": 0},
        ),
        # Plain prices, counts past where the form is exact.
        ({"input": "2.5", "output": "10"}, {"input_tokens": 3 * 10**10, "output_tokens": 7}),
        ({"input": "2.5", "output": "10"}, {"input_tokens": 5, "output_tokens": 10**13 + 1}),
    ],
)
def test_prices_and_counts_beyond_exact_arithmetic_are_priced_as_calc_price_prices_them_R_COST_1(
    monkeypatch, prices, stored
):
    """Where genai-prices' own 28-digit arithmetic rounds, a linear form
    derived from it would not give its figures (a helper found $13 off on
    $4.6e15, and a price dropped whole): such prices have no form, such
    counts are priced by calc_price, and the figure is calc_price's."""
    import json

    from costs.pricing import _override_price, _usage, linear_price, usage_counts

    monkeypatch.setenv("MODEL_PRICES", json.dumps({"x:m": prices}))
    get_config.cache_clear()
    try:
        config = get_config().MODEL_PRICES["x:m"]
        expected = Decimal(
            _override_price(config).calc_price(_usage(usage_counts(stored), catalogue=False))["total_price"]
        ).quantize(Decimal("1e-12"))
        cost = price_usage(model="x:m", usage=stored, at=AT)
        assert cost.usd == expected and str(cost.usd) == str(expected), (cost, expected)
        assert not cost.usd.is_signed()
        if any(len(v.split(".")[-1]) > 12 or "E-" in v for v in prices.values()):
            assert linear_price(_override_price(config), catalogue=False) is None
    finally:
        monkeypatch.delenv("MODEL_PRICES")
        get_config.cache_clear()
