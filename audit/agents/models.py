"""Chat models by name: ``provider:name`` (SPEC §5).

``replay:<scenario>`` goes to the project's replay model server;
``openai:<model>`` to an OpenAI-compatible endpoint. Both use
langchain-openai with ``stream_usage=True`` so that message-finish carries
the provider's usage (PROTOCOL.md §11), through
:class:`~audit.agents.provider.AuditedChatOpenAI`: usage folded by the
model's usage mode (R-MA-11) and our own retries before the first chunk
(R-RUN-12; the OpenAI SDK's retries are off so every attempt is audited).
"""

from __future__ import annotations

import functools
import ssl

import httpx

from core.config import get_config

from ..catalogue import UnknownModel
from .provider import AuditedChatOpenAI


@functools.cache
def _tls_context() -> ssl.SSLContext:
    # Loading the CA bundle takes tens of milliseconds; a context is safe to
    # share between clients and event loops, so it is built once per process.
    return httpx.create_ssl_context()


def model_http_client() -> httpx.AsyncClient:
    """A new HTTP client for the model calls of one run (one event loop),
    with the process's TLS context (same trust as httpx's default: the
    certifi bundle, or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``). The caller
    closes it (``async with``)."""
    return httpx.AsyncClient(timeout=120, verify=_tls_context())


def chat_model(
    name: str, *, http_async_client: httpx.AsyncClient | None = None, replay_url: str | None = None
) -> AuditedChatOpenAI:
    """Build the chat model for ``provider:name``.

    ``http_async_client`` should be a client owned by the caller's event
    loop: langchain-openai otherwise caches one process-wide, bound to the
    first loop, and a worker runs each run on a fresh loop. ``replay_url``:
    the replay model server a ``replay:`` model asks, instead of
    ``REPLAY_MODEL_URL`` (R-REPLAY-2).

    Raises :class:`UnknownModel` for an unknown provider.
    """
    provider, _, model = name.partition(":")
    config = get_config()
    if provider == "replay" and model:
        return AuditedChatOpenAI(
            configured_name=name,
            model=model,
            base_url=replay_url or config.REPLAY_MODEL_URL,
            api_key="replay",
            stream_usage=True,
            streaming=True,
            max_retries=0,
            timeout=60,
            http_async_client=http_async_client,
        )
    if provider == "openai" and model:
        return AuditedChatOpenAI(
            configured_name=name,
            model=model,
            base_url=config.OPENAI_BASE_URL or None,
            api_key=config.OPENAI_API_KEY or None,
            stream_usage=True,
            streaming=True,
            max_retries=0,
            timeout=120,
            http_async_client=http_async_client,
        )
    raise UnknownModel(f"unknown model provider in {name!r}: use replay:<scenario> or openai:<model>")
