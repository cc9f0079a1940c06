"""Typed configuration read from the environment.

Every setting the product reads from the environment is declared here once,
with its type and default. A malformed value (``LEASE_TTL_SECONDS=abc``, a
``DATABASE_URL`` with an unknown scheme) raises :class:`ConfigError` at start-up
naming the variable, instead of surfacing later as a confusing failure.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

BASE_DIR = Path(__file__).resolve().parent.parent


class ConfigError(RuntimeError):
    """An environment variable holds a value the product cannot use."""


class Config(BaseSettings):
    """The environment, parsed. Field names are the variable names."""

    model_config = SettingsConfigDict(case_sensitive=False, extra="ignore")

    # Empty means "embedded defaults": SQLite under var/ and an in-process
    # worker. Every consistency guarantee is only promised on PostgreSQL.
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
    # Attempts for one critical audit write before the run fails (R-RUN-8).
    AUDIT_WRITE_ATTEMPTS: int = Field(default=3, ge=1, le=20)
    # Tool results longer than this many characters go to the thread
    # workspace instead of the graph State (R-TA-4).
    LARGE_TOOL_RESULT_CHARS: int = Field(default=4000, ge=1)
    WORKSPACE_ROOT: Path = BASE_DIR / "var" / "workspaces"
    CELERY_QUEUE: str = "agent-runs"
    LANGFUSE_PUBLIC_KEY: str = ""
    LANGFUSE_SECRET_KEY: str = ""
    LANGFUSE_HOST: str = ""
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

    @field_validator("ALLOWED_HOSTS", "MODELS", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("DATABASE_URL")
    @classmethod
    def _known_database(cls, value: str) -> str:
        if value and value.split("://", 1)[0] not in {"postgres", "postgresql", "sqlite"}:
            raise ValueError("must start with postgres://, postgresql:// or sqlite://")
        return value

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
