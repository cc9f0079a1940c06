"""Typed configuration read from the environment.

Every setting the product reads from the environment is declared here once,
with its type and default. A malformed value (``LEASE_TTL_SECONDS=abc``, a
``DATABASE_URL`` with an unknown scheme) raises :class:`ConfigError` at start-up
naming the variable, instead of surfacing later as a confusing failure.
"""

from __future__ import annotations

import zoneinfo
from decimal import Decimal
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError

BASE_DIR = Path(__file__).resolve().parent.parent


class ConfigError(RuntimeError):
    """An environment variable holds a value the product cannot use."""


class ModelPriceConfig(BaseModel):
    """One ``MODEL_PRICES`` entry: USD per million tokens of each kind
    (R-COST-1). ``input`` and ``output`` are required; a kind left out is
    billed at its parent's price (cached input and cache creation as input,
    reasoning as output), as genai-prices does."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input: Decimal = Field(ge=0, allow_inf_nan=False)
    output: Decimal = Field(ge=0, allow_inf_nan=False)
    cached_input: Decimal | None = Field(default=None, ge=0, allow_inf_nan=False)
    cache_creation: Decimal | None = Field(default=None, ge=0, allow_inf_nan=False)
    reasoning: Decimal | None = Field(default=None, ge=0, allow_inf_nan=False)


class Config(BaseSettings):
    """The environment, parsed. Field names are the variable names."""

    model_config = SettingsConfigDict(case_sensitive=False, extra="ignore")

    # Empty: SQLite under var/, which the product's PostgreSQL statements do
    # not run on; bin/quickstart starts an embedded PostgreSQL instead.
    DATABASE_URL: str = ""
    # Celery broker and the live event stream. Empty: in-process worker and
    # events served from the database only.
    REDIS_URL: str = ""
    SECRET_KEY: str = "dev-insecure-change-me"
    DEBUG: bool = False
    ALLOWED_HOSTS: Annotated[list[str], NoDecode] = ["127.0.0.1", "localhost", "testserver"]
    # Model names users may pick for a thread, comma separated. Every bundled
    # replay scenario is always allowed as ``replay:<scenario>``.
    MODELS: Annotated[list[str], NoDecode] = []
    DEFAULT_MODEL: str = "replay:plain_answer"
    REPLAY_MODEL_URL: str = "http://127.0.0.1:8765/v1"
    OPENAI_BASE_URL: str = ""
    OPENAI_API_KEY: str = ""
    # Seconds a worker's lease on a run lasts without renewal (R-RUN-7).
    LEASE_TTL_SECONDS: float = Field(default=30.0, gt=0)
    # Seconds between two runs of the lease sweeper, which fails runs whose
    # lease expired (R-RUN-7). Celery beat schedules it.
    LEASE_SWEEP_INTERVAL_SECONDS: float = Field(default=10.0, gt=0)
    # Seconds a process waits for a pooled database connection before the
    # write counts as failed (then retried, R-RUN-8).
    DB_POOL_TIMEOUT_SECONDS: float = Field(default=10.0, gt=0)
    # Prepare the audit writes' statements on the server once per connection
    # (they are then planned once, not on every write). Turn off behind a
    # pooler that cannot keep prepared statements (PgBouncer before 1.21 in
    # transaction mode; see docs/SCALING.md).
    DB_PREPARED_STATEMENTS: bool = True
    # Attempts for one critical audit write before the run fails (R-RUN-8).
    AUDIT_WRITE_ATTEMPTS: int = Field(default=3, ge=1, le=20)
    # --- dispatch from PostgreSQL (R-RUN-9) ---
    # Seconds a run may wait at the head of its thread's queue, handed to
    # the broker, before the dispatcher hands it over again (its message may
    # be lost). A normal pickup takes well under a second.
    DISPATCH_GRACE_SECONDS: float = Field(default=10.0, gt=0)
    # Seconds between two runs of the dispatcher (Celery beat).
    DISPATCH_INTERVAL_SECONDS: float = Field(default=5.0, gt=0)
    # The queue of the dispatcher and the lease sweeper. Its own queue, served
    # by its own worker, so that busy run workers cannot starve them.
    CELERY_MAINTENANCE_QUEUE: str = "agent-maintenance"
    # --- bounded waits (R-RUN-10) ---
    # Milliseconds a web request waits for a run or thread row lock before it
    # answers 503 ``run_busy``.
    WEB_LOCK_TIMEOUT_MS: int = Field(default=1000, ge=1)
    # Worker connections: lock wait, statement time and idle time inside a
    # transaction after which PostgreSQL gives up (the last one ends a frozen
    # worker's transaction and releases its row lock).
    WORKER_LOCK_TIMEOUT_MS: int = Field(default=5000, ge=1)
    WORKER_STATEMENT_TIMEOUT_MS: int = Field(default=30000, ge=1)
    WORKER_IDLE_IN_TRANSACTION_TIMEOUT_MS: int = Field(default=5000, ge=1)
    # How long a run's terminal transaction waits for a dashboard rollup row
    # another transaction holds before it leaves the run to the catch-up of
    # the next dispatch round (R-DASH-1; dashboard.rollups.run_roll_up).
    ROLLUP_LOCK_WAIT_MS: int = Field(default=200, ge=1)
    # Tool results longer than this many characters go to the thread
    # workspace instead of the graph State (R-TA-4).
    LARGE_TOOL_RESULT_CHARS: int = Field(default=4000, ge=1)
    # Live events a run's Redis stream keeps (about: Redis trims in whole
    # nodes); a reader that needs older ones gets a ``gap`` event with the
    # run's state from PostgreSQL instead (R-EVT-2).
    EVENT_STREAM_MAXLEN: int = Field(default=50_000, ge=1)
    WORKSPACE_ROOT: Path = BASE_DIR / "var" / "workspaces"
    CELERY_QUEUE: str = "agent-runs"
    # How each model's provider reports token usage while streaming (R-MA-11):
    # JSON {"<model name>": "final" | "cumulative" | "delta"}; a model not
    # listed is "final", a replay:<scenario> model not listed takes the mode
    # its scenario turn declares. See README "Token usage".
    MODEL_USAGE_MODES: dict[str, Literal["final", "cumulative", "delta"]] = {}
    # Provider faults (R-RUN-12): attempts for one model request that fails
    # before its first streamed chunk (the first attempt included), and the
    # exponential backoff between them: initial * 2**(n-1) seconds plus a
    # random jitter of up to MODEL_RETRY_JITTER_SECONDS, capped at
    # MODEL_RETRY_MAX_DELAY_SECONDS. A provider's Retry-After is honoured; one
    # longer than the cap ends the retries.
    MODEL_RETRY_ATTEMPTS: int = Field(default=6, ge=1, le=20)
    MODEL_RETRY_INITIAL_DELAY_SECONDS: float = Field(default=0.5, ge=0)
    MODEL_RETRY_MAX_DELAY_SECONDS: float = Field(default=8.0, ge=0)
    MODEL_RETRY_JITTER_SECONDS: float = Field(default=0.5, ge=0)
    LANGFUSE_PUBLIC_KEY: str = ""
    LANGFUSE_SECRET_KEY: str = ""
    LANGFUSE_HOST: str = ""
    # Operations (R-OPS-1, ops/). A bearer token for Prometheus scrapers of
    # GET /metrics; empty: staff only (session or staff API token).
    METRICS_TOKEN: str = ""
    # False: record no metrics (the endpoint still answers).
    METRICS_ENABLED: bool = True
    # prometheus-client's multiprocess directory, read by the client from
    # the environment itself; validated here. The same empty directory for
    # the web and every worker process of a deployment.
    PROMETHEUS_MULTIPROC_DIR: str = ""
    # plain (human-readable) or json (one JSON object per line with
    # run_id, thread_id, request_id, worker).
    LOG_FORMAT: Literal["plain", "json"] = "plain"
    # Seconds GET /readyz waits for its checks in all.
    READYZ_TIMEOUT_SECONDS: float = Field(default=2.0, gt=0, le=30)
    # Cost (R-COST-1): JSON, model name -> USD per million tokens for
    # input, cached_input, cache_creation, output, reasoning. Overrides the
    # genai-prices catalogue and the replay models' default prices.
    MODEL_PRICES: dict[str, ModelPriceConfig] = {}
    # Budgets (R-COST-3): the zone whose days and months a budget period
    # follows, and the USD each unfinished run of a user holds against the
    # budget when another run is admitted.
    BUDGET_TIME_ZONE: str = "UTC"
    BUDGET_RUN_RESERVE_USD: Decimal = Field(default=Decimal("0.01"), ge=0, allow_inf_nan=False)
    # OpenTelemetry export of the audit (R-OTEL-1). The OTLP/HTTP base URL
    # (``/v1/traces`` is appended); empty: no export, no beat entry.
    OTEL_EXPORTER_OTLP_ENDPOINT: str = ""
    # Request headers, ``key=value`` pairs separated by commas (W3C baggage
    # format, as the OpenTelemetry SDKs read it), e.g. for Langfuse
    # ``Authorization=Basic <base64 of public:secret key>``.
    OTEL_EXPORTER_OTLP_HEADERS: str = ""
    # Seconds one export request may take, the SDK's retries included.
    OTEL_EXPORTER_OTLP_TIMEOUT: float = Field(default=10.0, gt=0)
    # Export message content and tool arguments and results (off: only ids,
    # names, timing, usage, status).
    OTEL_EXPORT_CONTENT: bool = False
    # Longest exported payload string, characters; longer ones are cut and
    # marked ``…[truncated N of M chars]``.
    OTEL_EXPORT_MAX_PAYLOAD_CHARS: int = Field(default=4000, ge=16)
    # Spans per OTLP request.
    OTEL_EXPORT_BATCH_SPANS: int = Field(default=512, ge=1, le=10000)
    # Seconds between two export passes (beat task, `export_otel` loop).
    OTEL_EXPORT_INTERVAL_SECONDS: float = Field(default=30.0, gt=0)
    # Seconds a finished run waits before export (clock skew margin, see
    # otel_export.selectors.export_horizon).
    OTEL_EXPORT_SETTLE_SECONDS: float = Field(default=5.0, ge=0)
    # Celery queue of the export task, apart from the agent runs.
    OTEL_EXPORT_QUEUE: str = "otel-export"
    # Retention (R-GOV-1): purge the payloads of audit rows of runs that
    # finished more than this many days ago (unset: keep them; the beat
    # task is then not scheduled), every RETENTION_PURGE_INTERVAL_SECONDS.
    RETENTION_DAYS: int | None = Field(default=None, ge=0)
    RETENTION_PURGE_INTERVAL_SECONDS: float = Field(default=3600.0, gt=0)

    @field_validator("ALLOWED_HOSTS", "MODELS", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("BUDGET_TIME_ZONE")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        if value not in zoneinfo.available_timezones():
            raise ValueError("must be an IANA time zone name such as UTC or Asia/Shanghai")
        return value

    @field_validator("DATABASE_URL")
    @classmethod
    def _known_database(cls, value: str) -> str:
        if value and value.split("://", 1)[0] not in {"postgres", "postgresql", "sqlite"}:
            raise ValueError("must start with postgres://, postgresql:// or sqlite://")
        return value

    @field_validator("PROMETHEUS_MULTIPROC_DIR")
    @classmethod
    def _writable_directory(cls, value: str) -> str:
        if value and not Path(value).is_dir():
            raise ValueError("must be an existing directory (create it, empty, before starting the processes)")
        return value

    @field_validator("LOG_FORMAT", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("OTEL_EXPORTER_OTLP_ENDPOINT")
    @classmethod
    def _http_endpoint(cls, value: str) -> str:
        if value and not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https:// (OTLP over HTTP)")
        return value

    @field_validator("OTEL_EXPORTER_OTLP_HEADERS")
    @classmethod
    def _headers(cls, value: str) -> str:
        for pair in filter(None, (part.strip() for part in value.split(","))):
            name, sep, _ = pair.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"{pair.split('=')[0][:40]!r} is not key=value")
        return value

    @field_validator("REDIS_URL")
    @classmethod
    def _known_redis(cls, value: str) -> str:
        if value and not value.startswith(("redis://", "rediss://")):
            raise ValueError("must start with redis:// or rediss://")
        return value


@lru_cache(maxsize=1)
def get_config() -> Config:
    """Return the parsed environment; raises :class:`ConfigError` on bad values."""
    try:
        return Config()
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors())
        raise ConfigError(f"invalid environment: {problems}") from None
    except SettingsError as exc:
        # A JSON setting (MODEL_PRICES) that is not JSON at all.
        raise ConfigError(f"invalid environment: {exc}") from None
