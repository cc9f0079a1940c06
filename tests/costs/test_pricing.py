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

from costs.pricing import REPLAY_DEFAULT_PRICES, price_usage
from yuxi_project.config import ModelPriceConfig, get_config

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
