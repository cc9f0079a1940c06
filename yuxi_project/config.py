"""Typed configuration read from the environment.

Every setting the product reads from the environment is declared here once,
with its type and default. A malformed value (``LEASE_TTL_SECONDS=abc``, a
``DATABASE_URL`` with an unknown scheme) raises :class:`ConfigError` at start-up
naming the variable, instead of surfacing later as a confusing failure.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError

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
    except SettingsError as exc:  # a JSON setting that is not JSON
        raise ConfigError(f"invalid environment: {exc}") from None
