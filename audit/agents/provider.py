"""The chat model the worker calls: langchain-openai's ``ChatOpenAI`` plus
the provider behaviour the audit must get right (R-MA-11, R-RUN-12).

- **Usage** (R-MA-11, R-MA-12): the usage reports of one call are folded by
  the model's usage mode (:mod:`audit.agents.usage`) and handed to LangChain
  as one report in a last chunk, so message-finish carries the billed total.
  A replay model learns the mode from the ``x-yuxi-usage-mode`` header of
  the answer it streams (response headers are read for that, then dropped:
  they never reach message-finish, the row or the State). Reports that
  contradict the mode give no report at all and ``usage_cause`` in the last
  chunk's ``response_metadata``, which the recorder stores on the row.
- **Retries before the first chunk** (R-RUN-12): a request that fails
  before its first streamed chunk — connection refused, reset or closed,
  timeout, HTTP 429 or 5xx — is sent again with exponential backoff and
  jitter (tenacity; settings ``MODEL_RETRY_*``), honouring the provider's
  ``Retry-After``. The OpenAI SDK's own retries are off, so every attempt
  is ours to see. All attempts belong to one LangChain model run, hence one
  operation id and one audit row: each failed attempt is reported through
  the run's ``on_retry`` callback (keyword ``attempt_failure``), which the
  worker writes onto the row (``metadata.attempts``,
  ``metadata.attempt_errors``).
- **Error types**: when the retries give up, the provider's exception is
  raised unchanged with ``audit_error_type`` set — ``model_unreachable``
  when no attempt got an HTTP response, ``model_http_error`` when the last
  one answered an error status, ``model_request_failed`` otherwise. A
  stream that breaks after its first chunk raises
  :class:`ModelStreamBroken` (``model_stream_broken``), never retried: what
  streamed is kept by the recorder.

- **Text a request cannot carry** (R-RUN-13): a lone surrogate or U+0000 in
  any text of the request (a tool's output or arguments, an earlier answer)
  is sent in its replacement form, its six-character escape
  (:func:`core.storable.sendable_text`); a lone surrogate once made the
  request unencodable and the call failed ``model_unreachable``.

The sync ``_stream`` folds usage too but does not retry: the worker drives
models asynchronously.
"""

from __future__ import annotations

import asyncio
import email.utils
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import httpx2
import openai
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.exceptions import ModelError
from langchain_core.messages import AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field
from tenacity import AsyncRetrying, RetryCallState, wait_exponential_jitter

from core.config import get_config
from core.errors import ApplicationError
from core.storable import sendable_json

from ..replay.scenarios import USAGE_MODE_HEADER
from .usage import UsageFold, UsageMode, usage_mode_for


class RetryPolicy(BaseModel):
    """Bounded retries for a model request that fails before its first
    chunk: at most ``attempts`` requests (the first included); before
    attempt n+1 wait ``min(initial_delay * 2**(n-1) + U(0, jitter),
    max_delay)`` seconds, or longer when the provider's ``Retry-After`` says
    so; a ``Retry-After`` above ``max_delay`` ends the retries."""

    model_config = ConfigDict(frozen=True)

    attempts: int = Field(default=6, ge=1)
    initial_delay: float = Field(default=0.5, ge=0)
    max_delay: float = Field(default=8.0, ge=0)
    jitter: float = Field(default=0.5, ge=0)

    @classmethod
    def from_config(cls) -> RetryPolicy:
        config = get_config()
        return cls(
            attempts=config.MODEL_RETRY_ATTEMPTS,
            initial_delay=config.MODEL_RETRY_INITIAL_DELAY_SECONDS,
            max_delay=config.MODEL_RETRY_MAX_DELAY_SECONDS,
            jitter=config.MODEL_RETRY_JITTER_SECONDS,
        )


@dataclass(frozen=True)
class AttemptFailure:
    """One model request that failed before its first chunk.

    ``connected``: the provider answered (an HTTP status, or the response
    had begun); ``retryable``: the kind of failure another attempt may cure;
    ``retry_after``: seconds the provider asked to wait (None: not said).
    """

    attempt: int
    error: str
    connected: bool
    retryable: bool
    status: int | None = None
    retry_after: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ModelStreamBroken(ModelError):
    """The model's stream broke after its first chunk (R-RUN-12): the call
    fails, what streamed is kept, and it is not retried (the provider may
    have billed it). ``__cause__`` is the transport's error."""

    audit_error_type = "model_stream_broken"


def attempt_failure(exc: BaseException, attempt: int) -> AttemptFailure:
    """Classify an exception raised before the first chunk of attempt
    ``attempt`` (1-based)."""
    error = f"{type(exc).__name__}: {exc}"[:500]
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        return AttemptFailure(
            attempt,
            error,
            connected=True,
            retryable=status == 429 or status >= 500,
            status=status,
            retry_after=retry_after_seconds(exc.response.headers),
        )
    if isinstance(exc, openai.APIConnectionError):  # refused, reset, closed, timed out
        return AttemptFailure(attempt, error, connected=False, retryable=True)
    if isinstance(exc, (httpx.TransportError, httpx2.TransportError, TimeoutError)):
        # Raised while reading a response that had begun (status 200, no
        # chunk yet): the connection broke or stalled before the first chunk.
        return AttemptFailure(attempt, error, connected=True, retryable=True)
    return AttemptFailure(attempt, error, connected=False, retryable=False)


def retry_after_seconds(headers: Any) -> float | None:
    """The wait a response asks for: ``retry-after-ms`` (OpenAI), else
    ``Retry-After`` in seconds or as an HTTP date; None when absent or
    unreadable."""
    value = headers.get("retry-after-ms")
    if value:
        try:
            return max(float(value) / 1000, 0.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


def failed_request_error_type(failures: list[AttemptFailure]) -> str:
    """The run's error type when a request gave up before its first chunk."""
    if not any(f.connected for f in failures):
        return "model_unreachable"
    if failures[-1].status is not None:
        return "model_http_error"
    return "model_request_failed"


RESPONSE_ID = "response_id"
"""The key of the provider's answer id in a model call's response metadata
and on its audit row's metadata (``gen_ai.response.id``, R-OTEL-2)."""


class AuditedChatOpenAI(ChatOpenAI):
    """``ChatOpenAI`` that folds usage by mode and retries requests that
    fail before their first chunk (see the module docstring).

    ``configured_name`` is the model's configured name (``provider:name``),
    from which the usage mode is resolved per request unless ``usage_mode``
    is set (:func:`audit.agents.usage.usage_mode_for`).
    """

    configured_name: str = ""
    usage_mode: UsageMode | None = None
    retry_policy: RetryPolicy = Field(default_factory=RetryPolicy.from_config)
    # The replay server names each answer's usage mode in a header (R-MA-12);
    # the headers are dropped once read (see _fold).
    include_response_headers: bool = True

    def _fold(self, first: ChatGenerationChunk | None) -> UsageFold:
        """The fold of one call, by the mode resolved from its first chunk
        (which carries the response headers): ``usage_mode`` if set, else
        :func:`~audit.agents.usage.usage_mode_for`."""
        headers = _pop_headers(first) if first is not None else {}
        served = next((str(v) for k, v in headers.items() if str(k).lower() == USAGE_MODE_HEADER), None)
        return UsageFold(self.usage_mode or usage_mode_for(self.configured_name, served))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        fold: UsageFold | None = None
        for chunk in super()._stream(messages, stop, run_manager, **kwargs):
            if fold is None:
                fold = self._fold(chunk)
            yield _without_usage(chunk, fold)
        if fold is not None and (last := _usage_chunk(fold)) is not None:
            yield last

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        stream, first = await self._open_stream(messages, stop, run_manager, kwargs)
        fold = self._fold(first)
        received = 0
        try:
            chunk = first
            while chunk is not None:
                received += 1
                yield _without_usage(chunk, fold)
                try:
                    chunk = await anext(stream)
                except StopAsyncIteration:
                    chunk = None
                except ApplicationError:
                    raise  # the project's own errors (a lost lease) pass as they are
                except Exception as exc:
                    raise ModelStreamBroken(
                        f"the model stream broke after {received} chunk(s): {type(exc).__name__}: {exc}"
                    ) from exc
        finally:
            await stream.aclose()
        if (last := _usage_chunk(fold)) is not None:
            yield last

    def _get_request_payload(self, input_: Any, *, stop: list[str] | None = None, **kwargs: Any) -> dict:
        # Every request, streamed or not, retried or not, is built here: a
        # lone surrogate or NUL in any text (a tool's output or arguments,
        # an earlier answer, a tool name) goes in its replacement form, so
        # the request can be encoded and sent (R-RUN-13).
        return sendable_json(super()._get_request_payload(input_, stop=stop, **kwargs))

    def _create_chat_result(self, response: Any, generation_info: dict | None = None) -> ChatResult:
        # A call that does not stream: its headers are of no use, keep them
        # out of the message's response_metadata.
        info = {k: v for k, v in (generation_info or {}).items() if k != "headers"}
        result = super()._create_chat_result(response, info or None)
        response_id = (response if isinstance(response, dict) else getattr(response, "__dict__", {})).get("id")
        if response_id and result.generations:
            result.generations[0].message.response_metadata[RESPONSE_ID] = str(response_id)
        return result

    def _convert_chunk_to_generation_chunk(
        self, chunk: dict, default_chunk_class: type, base_generation_info: dict | None
    ) -> ChatGenerationChunk | None:
        generation = super()._convert_chunk_to_generation_chunk(chunk, default_chunk_class, base_generation_info)
        # The provider's id of the answer (OpenAI's ``chatcmpl-…``), which
        # langchain-openai drops when streaming: put once, on the chunk that
        # ends the answer, into the response metadata that message-finish
        # carries (a string on several chunks would be concatenated).
        choices = chunk.get("choices") or []
        if generation is not None and chunk.get("id") and choices and choices[0].get("finish_reason"):
            generation.message.response_metadata[RESPONSE_ID] = str(chunk["id"])
        return generation

    async def _open_stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        run_manager: AsyncCallbackManagerForLLMRun | None,
        kwargs: dict[str, Any],
    ) -> tuple[AsyncIterator[ChatGenerationChunk], ChatGenerationChunk | None]:
        """Send the request until it yields a first chunk (or ends empty);
        returns the stream and that chunk. Raises the last attempt's error,
        with ``audit_error_type`` and ``model_attempts`` set, when the
        policy gives up or the error is not one to retry."""
        policy = self.retry_policy
        failures: list[AttemptFailure] = []
        backoff = wait_exponential_jitter(initial=policy.initial_delay, max=policy.max_delay, jitter=policy.jitter)

        def retryable(state: RetryCallState) -> bool:
            # Only an attempt whose own failure was classified (the last one
            # recorded) may be retried; anything else is raised as it is.
            return bool(failures) and failures[-1].attempt == state.attempt_number and failures[-1].retryable

        def wait(state: RetryCallState) -> float:
            return max(backoff(state), failures[-1].retry_after or 0.0)

        def stop_retrying(state: RetryCallState) -> bool:
            asks = failures[-1].retry_after
            return state.attempt_number >= policy.attempts or (asks is not None and asks > policy.max_delay)

        async def before_sleep(state: RetryCallState) -> None:
            if run_manager is not None:
                await run_manager.on_retry(
                    state,
                    attempt_failure={**failures[-1].as_dict(), "retry_in_ms": round(state.upcoming_sleep * 1000)},
                )

        retrying = AsyncRetrying(
            stop=stop_retrying,
            wait=wait,
            retry=retryable,
            before_sleep=before_sleep,
            reraise=True,
            sleep=asyncio.sleep,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    stream = super()._astream(messages, stop, run_manager, **kwargs)
                    try:
                        return stream, await anext(stream)
                    except StopAsyncIteration:
                        return stream, None
                    except ApplicationError:
                        await stream.aclose()
                        raise
                    except Exception as exc:
                        await stream.aclose()
                        failures.append(attempt_failure(exc, attempt.retry_state.attempt_number))
                        raise
                    except BaseException:  # cancelled: release the connection, never retry
                        await stream.aclose()
                        raise
        except ApplicationError:
            raise
        except Exception as exc:
            if failures:
                exc.audit_error_type = failed_request_error_type(failures)  # type: ignore[attr-defined]
                exc.model_attempts = [f.as_dict() for f in failures]  # type: ignore[attr-defined]
                exc.add_note(f"model request failed after {len(failures)} attempt(s)")
            raise
        raise AssertionError("unreachable: tenacity returns or raises")


def _pop_headers(chunk: ChatGenerationChunk) -> dict[str, Any]:
    """The response headers langchain-openai put on the first chunk's
    ``generation_info`` (``include_response_headers``), removed from it."""
    info = chunk.generation_info
    headers = info.pop("headers", None) if info else None
    return headers if isinstance(headers, dict) else {}


def _without_usage(chunk: ChatGenerationChunk, fold: UsageFold) -> ChatGenerationChunk:
    message = chunk.message
    if isinstance(message, AIMessageChunk) and message.usage_metadata:
        fold.add(message.usage_metadata)
        message.usage_metadata = None
    return chunk


def _usage_chunk(fold: UsageFold) -> ChatGenerationChunk | None:
    """The one usage report LangChain sees: an empty last chunk, as OpenAI
    sends its usage (``choices: []``); for reports that contradict the mode,
    no usage and the cause in ``response_metadata["usage_cause"]`` (R-MA-12);
    None when the provider reported nothing."""
    total = fold.total()
    if total is None and fold.cause is None:
        return None
    cause = {"usage_cause": fold.cause} if fold.cause else {}
    return ChatGenerationChunk(message=AIMessageChunk(content="", usage_metadata=total, response_metadata=cause))
