"""Optional Langfuse tracing (R-TRC-1).

When Langfuse is configured (``LANGFUSE_PUBLIC_KEY``, ``LANGFUSE_SECRET_KEY``,
``LANGFUSE_HOST``), each run gets a trace whose id is derived from the run id
and stored on the ``AgentRun`` before the first model call. Langfuse being
off, misconfigured or unreachable never affects the run or its audit: every
failure here is logged and the run goes on untraced. Spans are exported by
the SDK's background exporter, never on the audit path.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from core.config import get_config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunTrace:
    """The trace of one run: its id and the LangChain callbacks that feed it."""

    trace_id: str = ""
    callbacks: list[Any] = field(default_factory=list)


def langfuse_configured() -> bool:
    config = get_config()
    return bool(config.LANGFUSE_PUBLIC_KEY and config.LANGFUSE_SECRET_KEY)


def start_run_trace(run_id: uuid.UUID) -> RunTrace:
    """Open the Langfuse trace of a run, or an empty :class:`RunTrace` when
    Langfuse is off or cannot be set up (never raises)."""
    if not langfuse_configured():
        return RunTrace()
    config = get_config()
    try:
        from langfuse import Langfuse
        from langfuse.langchain import CallbackHandler

        # One client per process and public key (the SDK keeps a registry).
        Langfuse(
            public_key=config.LANGFUSE_PUBLIC_KEY,
            secret_key=config.LANGFUSE_SECRET_KEY,
            host=config.LANGFUSE_HOST or None,
            timeout=5,
        )
        trace_id = Langfuse.create_trace_id(seed=str(run_id))
        handler = CallbackHandler(public_key=config.LANGFUSE_PUBLIC_KEY, trace_context={"trace_id": trace_id})
    except Exception as exc:  # misconfigured or broken SDK: run untraced
        log.warning("Langfuse tracing is off for run %s: %s: %s", run_id, type(exc).__name__, exc)
        return RunTrace()
    return RunTrace(trace_id=trace_id, callbacks=[handler])
