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

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError

BASE_DIR = Path(__file__).resolve().parent.parent


# The SECRET_KEY of an unconfigured checkout: public, so refused with DEBUG
# off (yuxi_project.deploy_guard, R-SEC-1).
INSECURE_SECRET_KEY = "dev-insecure-change-me"


def proxy_ssl_header(value: str) -> tuple[str, str] | None:
    """``SECURE_PROXY_SSL_HEADER`` (``"X-Forwarded-Proto: https"``) as
    Django's setting wants it (``("HTTP_X_FORWARDED_PROTO", "https")``);
    None when it is not a header name, a colon and a value."""
    name, colon, expected = value.partition(":")
    name, expected = name.strip(), expected.strip()
    if not colon or not expected or not name or not all(c.isalnum() or c == "-" for c in name):
        return None
    return "HTTP_" + name.upper().replace("-", "_"), expected


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
    """The environment, parsed. Field names are the variable names; each
    field's ``description`` is its entry in ``docs/configuration.md``, which
    ``manage.py config_reference --write docs/configuration.md`` renders from
    this class (a test fails when the two differ)."""

    model_config = SettingsConfigDict(case_sensitive=False, extra="ignore")

    # --- services ---
    DATABASE_URL: str = Field(
        default="",
        description=(
            "PostgreSQL, `postgres://user@host:port/name`. Unset: SQLite under `var/`, which the product's "
            "PostgreSQL statements do not run on; `bin/quickstart` and `bin/test` set "
            "`postgres://postgres@127.0.0.1:5432/yuxi` when it is unset, and `bin/quickstart` starts an "
            "embedded PostgreSQL when that does not answer."
        ),
    )
    REDIS_URL: str = Field(
        default="",
        description=(
            "Redis, the Celery broker and the live event stream; `rediss://` verifies the server certificate "
            "(add `?ssl_cert_reqs=none` to opt out). Unset: runs execute in an in-process worker thread and "
            "`/events` sends only the terminal event, rebuilt from PostgreSQL. `bin/quickstart` sets database 0 "
            "of a local Redis, `bin/test` database 15."
        ),
    )
    CELERY_QUEUE: str = Field(default="agent-runs", description="The Celery queue of agent runs.")
    # Its own queue, served by its own worker, so that busy run workers
    # cannot starve the dispatcher and the sweeper.
    CELERY_MAINTENANCE_QUEUE: str = Field(
        default="agent-maintenance",
        description="The queue of the dispatcher and the lease sweeper, served by its own worker (R-RUN-9).",
    )
    # --- Django ---
    SECRET_KEY: str = Field(
        default=INSECURE_SECRET_KEY,
        description=(
            "Django's secret key (sessions, CSRF, password reset links): 50 or more random characters, "
            "`python -c 'import secrets; print(secrets.token_urlsafe(50))'`. With `DEBUG` off the web server and "
            "the workers refuse to start on the default, which is public (R-SEC-1); `bin/quickstart` makes one "
            "for its checkout in `var/secret_key`."
        ),
    )
    DEBUG: bool = Field(default=False, description="Django's debug mode.")
    ALLOWED_HOSTS: Annotated[list[str], NoDecode] = Field(
        default=["127.0.0.1", "localhost", "testserver"],
        description="Host names the web server answers, comma separated.",
    )
    # --- HTTPS (R-SEC-1): Django's settings of the same names ---
    SECURE_SSL_REDIRECT: bool = Field(
        default=False,
        description=(
            "Redirect every plain-HTTP request to HTTPS. Behind a proxy that ends TLS, set "
            "`SECURE_PROXY_SSL_HEADER` too (or the redirect never ends)."
        ),
    )
    SECURE_PROXY_SSL_HEADER: str = Field(
        default="",
        description=(
            "The header and value by which the reverse proxy says a request came over HTTPS, "
            "`X-Forwarded-Proto: https`. Only behind a proxy that sets it and drops it from what clients send. "
            "Unset: a request is HTTPS only when it reached the web server over TLS."
        ),
    )
    SECURE_HSTS_SECONDS: int = Field(
        default=0,
        ge=0,
        description=(
            "`Strict-Transport-Security` max-age on HTTPS responses, in seconds; 0 sends none. Start with 300 and "
            "raise it to a year (31536000) once every page works over HTTPS: browsers then refuse plain HTTP."
        ),
    )
    SECURE_HSTS_INCLUDE_SUBDOMAINS: bool = Field(
        default=False, description="Add `includeSubDomains` to `Strict-Transport-Security`."
    )
    SECURE_HSTS_PRELOAD: bool = Field(default=False, description="Add `preload` to `Strict-Transport-Security`.")
    SESSION_COOKIE_SECURE: bool = Field(
        default=False, description="Send the session cookie (admin, dashboard) over HTTPS only."
    )
    CSRF_COOKIE_SECURE: bool = Field(default=False, description="Send the CSRF cookie over HTTPS only.")
    CSRF_TRUSTED_ORIGINS: Annotated[list[str], NoDecode] = Field(
        default=[],
        description=(
            "Origins allowed to send forms and unsafe requests besides the site's own, comma separated, each with "
            "its scheme: `https://audit.example.com`. Needed when a proxy serves the site under another origin."
        ),
    )
    # --- models ---
    MODELS: Annotated[list[str], NoDecode] = Field(
        default=[],
        description=(
            "Model names users may pick for a thread besides the bundled replay scenarios, comma separated "
            "(`openai:gpt-4o-mini`). Every `replay:<scenario>` is always allowed."
        ),
    )
    DEFAULT_MODEL: str = Field(default="replay:plain_answer", description="A new thread's model.")
    REPLAY_MODEL_URL: str = Field(
        default="http://127.0.0.1:8765/v1", description="The replay model server (`manage.py replay_model_server`)."
    )
    OPENAI_BASE_URL: str = Field(default="", description="Endpoint of `openai:` models (any OpenAI-compatible server).")
    OPENAI_API_KEY: str = Field(default="", description="API key of `openai:` models.")
    MODEL_USAGE_MODES: dict[str, Literal["final", "cumulative", "delta"]] = Field(
        default={},
        description=(
            'JSON `{"<model name>": "final" | "cumulative" | "delta"}`: how each provider reports token usage '
            "while streaming (R-MA-11). A model not listed is `final`; a `replay:` model not listed takes its "
            "scenario turn's mode. See [models and agents](models-and-agents.md)."
        ),
    )
    MODEL_RETRY_ATTEMPTS: int = Field(
        default=6,
        ge=1,
        le=20,
        description=(
            "Requests for one model call that fails before its first streamed chunk, the first included (R-RUN-12)."
        ),
    )
    MODEL_RETRY_INITIAL_DELAY_SECONDS: float = Field(
        default=0.5,
        ge=0,
        description=(
            "Backoff between those requests: this × 2^(n−1) seconds, plus up to "
            "`MODEL_RETRY_JITTER_SECONDS`, at most `MODEL_RETRY_MAX_DELAY_SECONDS` (about 16 s in all by "
            "default). A provider's `Retry-After` is honoured; one above the cap ends the retries."
        ),
    )
    MODEL_RETRY_MAX_DELAY_SECONDS: float = Field(
        default=8.0, ge=0, description="The longest wait between two requests."
    )
    MODEL_RETRY_JITTER_SECONDS: float = Field(default=0.5, ge=0, description="The random part of each wait, at most.")
    # --- runs, leases and dispatch (R-RUN-7..10) ---
    LEASE_TTL_SECONDS: float = Field(
        default=30.0, gt=0, description="How long a worker's lease on a run lasts without renewal (R-RUN-7)."
    )
    LEASE_SWEEP_INTERVAL_SECONDS: float = Field(
        default=10.0,
        gt=0,
        description="How often Celery beat runs the lease sweeper, which fails runs whose lease expired (R-RUN-7).",
    )
    RUN_RECOVERY: Literal["resume", "fail"] = Field(
        default="resume",
        description=(
            "What the lease sweeper does with a run whose worker died: `resume` puts it back to `pending` "
            "with `attempt` + 1 for another worker to continue from its last checkpoint; `fail` ends it "
            "`failed`, `lease_expired` (R-RUN-15)."
        ),
    )
    RUN_RECOVERY_ATTEMPTS: int = Field(
        default=3,
        ge=0,
        le=100,
        description=(
            "How many times one run is continued after its worker died; the next expiry ends it `failed`, "
            "`lease_expired` (R-RUN-15)."
        ),
    )
    AUDIT_WRITE_ATTEMPTS: int = Field(
        default=3, ge=1, le=20, description="Tries of one audit write before the run fails (R-RUN-8)."
    )
    DB_POOL_TIMEOUT_SECONDS: float = Field(
        default=10.0,
        gt=0,
        description=(
            "Wait for a pooled database connection before a write counts as failed and is retried (R-RUN-8); "
            "workers wait at most a sixth of the lease."
        ),
    )
    DB_PREPARED_STATEMENTS: bool = Field(
        default=True,
        description=(
            "Prepare the audit writes' statements on the server once per connection, so they are planned once. "
            "`false` behind a pooler that cannot keep prepared statements (PgBouncer before 1.21 in transaction "
            "mode; see [scaling](scaling.md))."
        ),
    )
    # A normal pickup takes well under a second; the grace covers a lost
    # broker message.
    DISPATCH_GRACE_SECONDS: float = Field(
        default=10.0,
        gt=0,
        description=(
            "A pending run at the head of its thread not picked up for this long is handed to the broker again "
            "(R-RUN-9)."
        ),
    )
    DISPATCH_INTERVAL_SECONDS: float = Field(
        default=5.0, gt=0, description="How often Celery beat runs the dispatcher."
    )
    WEB_LOCK_TIMEOUT_MS: int = Field(
        default=1000,
        ge=1,
        description="A web request's wait for a run or thread row lock, then 503 `run_busy` (R-RUN-10).",
    )
    # The idle-in-transaction limit is what ends a frozen worker's
    # transaction and releases its row lock.
    WORKER_LOCK_TIMEOUT_MS: int = Field(
        default=5000, ge=1, description="Worker connections' `lock_timeout` (R-RUN-10)."
    )
    WORKER_STATEMENT_TIMEOUT_MS: int = Field(
        default=30000, ge=1, description="Worker connections' `statement_timeout`."
    )
    WORKER_IDLE_IN_TRANSACTION_TIMEOUT_MS: int = Field(
        default=5000,
        ge=1,
        description=(
            "Worker connections' `idle_in_transaction_session_timeout`: PostgreSQL ends a frozen worker's "
            "transaction and releases its row."
        ),
    )
    # --- tools, events, dashboard ---
    LARGE_TOOL_RESULT_CHARS: int = Field(
        default=4000,
        ge=1,
        description="Tool results longer than this many characters go to the thread workspace, not the State (R-TA-4).",
    )
    WORKSPACE_ROOT: Path = Field(default=BASE_DIR / "var" / "workspaces", description="Per-thread workspace folders.")
    EVENT_STREAM_MAXLEN: int = Field(
        default=50_000,
        ge=1,
        description=(
            "Live events a run's Redis stream keeps (about: Redis trims in whole nodes); a reader that needs "
            "older ones gets a `gap` event with the run's state from PostgreSQL (R-EVT-2)."
        ),
    )
    ROLLUP_LOCK_WAIT_MS: int = Field(
        default=200,
        ge=1,
        description=(
            "How long a run's end waits for a dashboard rollup row another transaction holds; past it the run is "
            "rolled up by the next dispatch round, and counted from its rows meanwhile (R-DASH-1)."
        ),
    )
    # --- cost and budgets ---
    MODEL_PRICES: dict[str, ModelPriceConfig] = Field(
        default={},
        description=(
            'JSON: model name → USD per million tokens, e.g. `{"openai:my-llama": {"input": 0.2, "output": 0.6}}`; '
            "`input` and `output` required, `cached_input`, `cache_creation`, `reasoning` optional. Overrides the "
            "genai-prices catalogue and the replay defaults (R-COST-1)."
        ),
    )
    BUDGET_TIME_ZONE: str = Field(
        default="UTC", description="The IANA zone whose days and months budget periods follow (R-COST-3)."
    )
    BUDGET_RUN_RESERVE_USD: Decimal = Field(
        default=Decimal("0.01"),
        ge=0,
        allow_inf_nan=False,
        description="USD each unfinished run holds against its user's budget when another run is submitted.",
    )
    # --- operations (R-OPS-1) ---
    METRICS_TOKEN: str = Field(
        default="",
        description="Bearer token for Prometheus scrapers of `GET /metrics`. Unset: staff only (session or staff API token).",
    )
    METRICS_ENABLED: bool = Field(default=True, description="`false`: record no metrics (the endpoint still answers).")
    # prometheus-client reads it from the environment itself; validated here.
    PROMETHEUS_MULTIPROC_DIR: str = Field(
        default="",
        description=(
            "One existing, empty directory shared by the web and every worker process of one host, so `/metrics` "
            "adds up every process (at each scrape the live gauges of processes that are gone are dropped and "
            "their counters and histograms summed into one archive file per type). Unset: each process's own "
            "values only."
        ),
    )
    LOG_FORMAT: Literal["plain", "json"] = Field(
        default="plain",
        description="`json`: one JSON object per line with `run_id`, `thread_id`, `request_id` and `worker`.",
    )
    READYZ_TIMEOUT_SECONDS: float = Field(
        default=2.0, gt=0, le=30, description="How long `GET /readyz` waits for its checks in all."
    )
    LANGFUSE_PUBLIC_KEY: str = Field(
        default="",
        description=(
            "Optional Langfuse tracing (with `LANGFUSE_SECRET_KEY`, `LANGFUSE_HOST`; "
            "`pip install -e '.[langfuse]'`): the run's trace id is stored on the run; Langfuse failures never "
            "affect a run. Unset: off."
        ),
    )
    LANGFUSE_SECRET_KEY: str = Field(default="", description="See `LANGFUSE_PUBLIC_KEY`.")
    LANGFUSE_HOST: str = Field(default="", description="See `LANGFUSE_PUBLIC_KEY`.")
    # --- OpenTelemetry export (R-OTEL-1) ---
    OTEL_EXPORTER_OTLP_ENDPOINT: str = Field(
        default="",
        description=(
            "OTLP/HTTP base URL for `export_otel` and its beat task (`/v1/traces` is appended). Unset: no export, "
            "no beat entry. See [export](export.md)."
        ),
    )
    OTEL_EXPORTER_OTLP_HEADERS: str = Field(
        default="",
        description=(
            "Request headers, `key=value` pairs separated by commas, e.g. for Langfuse "
            "`Authorization=Basic <base64 of public:secret key>`."
        ),
    )
    OTEL_EXPORTER_OTLP_TIMEOUT: float = Field(
        default=10.0, gt=0, description="Seconds one export request may take, the SDK's retries included."
    )
    OTEL_EXPORT_CONTENT: bool = Field(
        default=False,
        description="Also export message content and tool arguments and results (off: ids, names, timing, usage, status).",
    )
    OTEL_EXPORT_MAX_PAYLOAD_CHARS: int = Field(
        default=4000,
        ge=16,
        description="Longest exported payload string; longer ones are cut and marked `…[truncated N of M chars]`.",
    )
    OTEL_EXPORT_BATCH_SPANS: int = Field(default=512, ge=1, le=10000, description="Spans per OTLP request.")
    OTEL_EXPORT_INTERVAL_SECONDS: float = Field(
        default=30.0, gt=0, description="Seconds between two export passes (beat task, `export_otel` without `--once`)."
    )
    OTEL_EXPORT_SETTLE_SECONDS: float = Field(
        default=5.0,
        ge=0,
        description="Seconds a finished run waits before export (a clock skew margin; `otel_export.selectors.export_horizon`).",
    )
    OTEL_EXPORT_QUEUE: str = Field(
        default="otel-export", description="Celery queue of the export task, apart from the agent runs."
    )
    # --- webhooks (R-API-3) ---
    WEBHOOK_ALLOWED_HOSTS: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description=(
            "Hosts a submit or resume may name in `webhook`, separated by commas: `hooks.example.com` matches "
            "that host, `.example.com` it and its subdomains. Empty: every `webhook` is refused (403 "
            "`webhook_not_allowed`) and nothing is delivered. See [webhooks](api.md#webhooks)."
        ),
    )
    WEBHOOK_SECRET: str = Field(
        default="",
        description=(
            "Key of the `X-Yuxi-Signature` HMAC-SHA256 over each delivery's body. Required with "
            "`WEBHOOK_ALLOWED_HOSTS`: without it every `webhook` is refused."
        ),
    )
    WEBHOOK_TIMEOUT_SECONDS: float = Field(
        default=10.0, gt=0, le=300, description="Seconds one delivery request may take before it counts as failed."
    )
    WEBHOOK_MAX_ATTEMPTS: int = Field(
        default=20,
        ge=1,
        le=1000,
        description=(
            "Attempts of one delivery before it is given up (`failed`, kept in the admin). Retries wait "
            "`WEBHOOK_RETRY_BASE_SECONDS` doubled at each attempt, at most `WEBHOOK_RETRY_MAX_SECONDS`."
        ),
    )
    WEBHOOK_RETRY_BASE_SECONDS: float = Field(
        default=5.0, gt=0, description="Seconds before the first retry of a failed delivery."
    )
    WEBHOOK_RETRY_MAX_SECONDS: float = Field(
        default=3600.0, gt=0, description="Longest wait between two attempts of one delivery."
    )
    WEBHOOK_INTERVAL_SECONDS: float = Field(
        default=2.0,
        gt=0,
        description=(
            "Seconds between two delivery passes (beat task `webhooks.deliver`, scheduled when "
            "`WEBHOOK_ALLOWED_HOSTS` is set); a pass also stops after this long."
        ),
    )
    WEBHOOK_SETTLE_SECONDS: float = Field(
        default=2.0,
        ge=0,
        description="Seconds an ended run waits before its delivery is queued (a clock skew margin, as for the export).",
    )
    WEBHOOK_QUEUE: str = Field(
        default="webhooks", description="Celery queue of the delivery task, apart from the agent runs."
    )
    # --- retention (R-GOV-1) ---
    RETENTION_DAYS: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Purge the payloads of audit rows of runs that finished more than this many days ago (a beat task). "
            "Unset: keep them; the task is not scheduled. See [governance](governance.md)."
        ),
    )
    RETENTION_PURGE_INTERVAL_SECONDS: float = Field(
        default=3600.0, gt=0, description="How often Celery beat runs that purge."
    )

    # --- signed digests (R-GOV-5) ---
    # The names these two had when digests were first built are still read.
    AUDIT_SIGNING_KEY: str = Field(
        default="",
        validation_alias=AliasChoices("AUDIT_SIGNING_KEY", "AUDIT_DIGEST_PRIVATE_KEY"),
        description=(
            "The Ed25519 private key that signs the audit digests, PEM (PKCS#8), e.g. from "
            "`openssl genpkey -algorithm ed25519`. Or `AUDIT_SIGNING_KEY_FILE`. Never stored in the "
            "database. Neither set: no digest is published. See [governance](governance.md#signed-digests). Its "
            "first name, `AUDIT_DIGEST_PRIVATE_KEY` (and `_FILE`), is read too."
        ),
    )
    AUDIT_SIGNING_KEY_FILE: str = Field(
        default="",
        validation_alias=AliasChoices("AUDIT_SIGNING_KEY_FILE", "AUDIT_DIGEST_PRIVATE_KEY_FILE"),
        description="A file holding that private key (PEM), instead of `AUDIT_SIGNING_KEY`.",
    )
    AUDIT_DIGEST_DIR: str = Field(
        default="var/digests",
        description="The folder the signed digests are appended to (`digests.jsonl`), besides the database.",
    )
    AUDIT_DIGEST_INTERVAL_SECONDS: int = Field(
        default=3600, ge=1, description="The length of one digest's interval: the runs sealed in it."
    )
    AUDIT_DIGEST_GRACE_SECONDS: int = Field(
        default=300,
        ge=0,
        description=(
            "How long after an interval ends its digest waits, so that every terminal transaction that "
            "sealed a run in it has committed (worker transactions are bounded by their timeouts)."
        ),
    )

    @field_validator("ALLOWED_HOSTS", "MODELS", "CSRF_TRUSTED_ORIGINS", "WEBHOOK_ALLOWED_HOSTS", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("CSRF_TRUSTED_ORIGINS")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        for origin in value:
            if not origin.startswith(("https://", "http://")) or origin.count("/") != 2:
                raise ValueError(f"{origin!r}: each origin is a scheme and a host, such as https://audit.example.com")
        return value

    @field_validator("WEBHOOK_ALLOWED_HOSTS")
    @classmethod
    def _webhook_hosts(cls, value: list[str]) -> list[str]:
        for host in value:
            name = host.removeprefix(".")
            if not name or "/" in host or ":" in host or "*" in host or " " in host:
                raise ValueError(f"{host!r}: each entry is a host name, such as hooks.example.com or .example.com")
        return [host.lower() for host in value]

    @field_validator("SECURE_PROXY_SSL_HEADER")
    @classmethod
    def _proxy_header(cls, value: str) -> str:
        if value and proxy_ssl_header(value) is None:
            raise ValueError("must be a header and its value, such as 'X-Forwarded-Proto: https'")
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
