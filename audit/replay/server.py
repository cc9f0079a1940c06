"""The replay model server: an OpenAI-compatible ``/v1/chat/completions``
endpoint (streaming and non-streaming) that plays scenario files
deterministically (SPEC §5, "Models and the replay model server").

The request's ``model`` is the scenario name (``<scenario>/<subagent>`` for
a subagent's own turns, R-SUB-1). Turn selection is stateless:
the turn index is the number of ``assistant`` messages after the last
``user`` message, so a client that re-sends the whole history (for example
on resume after a human-approval interrupt) gets the right turn.

Routes: ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{name}``, ``GET /healthz``.

Provider behaviours a turn can play (see :class:`~audit.replay.scenarios.Turn`):
usage reported ``final`` / ``cumulative`` / ``delta`` with token details
(R-MA-11; a streamed answer names its turn's mode in the
``x-yuxi-usage-mode`` header, R-MA-12), connections closed before any
response (``connect_error_times``) and HTTP errors before the first chunk
(``fail_before_first_chunk``) (R-RUN-12). The last two need the only state the server keeps: how many
times it has seen each distinct request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.types import Send

from .scenarios import REJECTION_PREFIX, USAGE_MODE_HEADER, Scenario, Turn, Usage, load_scenarios, scenario_turns

logger = logging.getLogger(__name__)

CREATED = 1_700_000_000
"""Fixed ``created`` timestamp (s) of every completion and chunk, so answers
are byte-for-byte reproducible."""

SYSTEM_FINGERPRINT = "replay"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "conflict_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class _AbortStream:
    """Yielded by a chunk generator to break the connection: the response
    is left incomplete, so the client sees a protocol error mid-stream."""


_ABORT = _AbortStream()


class _ReplayStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that can end without completing the HTTP body.

    Returning from the ASGI call without the final ``more_body=False``
    message makes uvicorn close the connection, which the client reads as an
    incomplete chunked body: a real mid-stream failure, not an error event.
    """

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        sent = 0
        try:
            async for chunk in self.body_iterator:
                if chunk is _ABORT:
                    return
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                sent += 1
        except (asyncio.CancelledError, OSError):
            # Starlette cancels the body when the client disconnects: the
            # model call was really stopped (cancellation tests read this).
            logger.info("replay: the client closed the stream after %d chunk(s)", sent)
            raise
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _close_connection(request: Request) -> JSONResponse:
    """Close the client's connection without sending any response: the
    client sees the server disconnect before a status line, like a refused
    or reset connection (R-RUN-12).

    ASGI has no message for this, so the socket is reached through
    uvicorn's request cycle (the ``receive`` callable is its bound method).
    Without a socket (an in-process ASGI client) the exception raised here
    reaches the client instead, which it reads the same way.
    """
    transport = getattr(getattr(request.receive, "__self__", None), "transport", None)
    if transport is None:
        raise ConnectionResetError("replay: connect_error_times (no socket to close)")
    transport.abort()
    # Let uvicorn see the disconnect before the app returns, so it does not
    # try to answer 500 on the closed socket.
    for _ in range(3):
        await asyncio.sleep(0)
    return JSONResponse({}, status_code=599)


def error_response(status: int, message: str, *, code: str | None, error_type: str | None = None) -> JSONResponse:
    """An OpenAI-style error: ``{"error": {"message", "type", "code", "param"}}``
    with HTTP ``status``; ``error_type`` defaults from the status."""
    if error_type is None:
        error_type = "server_error" if status >= 500 else _ERROR_TYPES.get(status, "invalid_request_error")
    body = {"error": {"message": message, "type": error_type, "code": code, "param": None}}
    return JSONResponse(body, status_code=status)


STALL_SECONDS = 600.0
"""How long a ``stall_after_chunks`` turn holds its connection before it
breaks it (a bound, so a forgotten client does not hold a task forever)."""


def turn_index(messages: list[dict[str, Any]]) -> int:
    """Number of ``assistant`` messages after the last ``user`` message in
    ``messages`` (OpenAI chat messages, dicts with a ``role``); with no user
    message, all assistant messages count."""
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    return sum(1 for m in messages[last_user + 1 :] if m.get("role") == "assistant")


def rejected_in_turn(messages: list[dict[str, Any]]) -> bool:
    """True when a ``tool`` message after the last ``user`` message of
    ``messages`` (OpenAI chat messages; with no user message, any) is a
    human's rejection of the call (its text begins with
    :data:`REJECTION_PREFIX`, R-TA-5): the rejection holds for the rest of
    the turn, so a scenario that calls more tools after it still answers
    truthfully at the end (``approval_then_large_lookup``). The same bound
    as :func:`turn_index`: a rejection in an earlier turn of the thread
    does not count."""
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    for message in messages[last_user + 1 :]:
        if message.get("role") != "tool":
            continue
        content = message.get("content")
        if isinstance(content, list):  # content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if isinstance(content, str) and content.startswith(REJECTION_PREFIX):
            return True
    return False


def _request_digest(scenario: str, index: int, messages: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps([scenario, index, messages], sort_keys=True, default=str).encode()).hexdigest()


def _completion_id(scenario: str, index: int, messages: list[dict[str, Any]]) -> str:
    # Deterministic for a given request, yet distinct across conversations:
    # the audit may key provider response ids, and two threads playing the
    # same scenario must not collide.
    return f"chatcmpl-replay-{_request_digest(scenario, index, messages)[:24]}"


def _usage_object(
    usage: Usage | None, prompt: int, completion: int, cached: int, cache_write: int, reasoning: int
) -> dict[str, Any]:
    """An OpenAI ``usage`` object; the details objects only when the
    scenario declares them, with the figures given."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if usage is not None and usage.prompt_tokens_details is not None:
        details = usage.prompt_tokens_details
        body["prompt_tokens_details"] = {
            **({"cached_tokens": cached} if details.cached_tokens is not None else {}),
            **({"cache_write_tokens": cache_write} if details.cache_write_tokens is not None else {}),
        }
    if usage is not None and usage.completion_tokens_details is not None:
        if usage.completion_tokens_details.reasoning_tokens is not None:
            body["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        else:
            body["completion_tokens_details"] = {}
    return body


def _figures(usage: Usage | None) -> tuple[int, int, int, int, int]:
    """(prompt, completion, cached, cache write, reasoning) billed totals."""
    if usage is None:
        return 0, 0, 0, 0, 0
    prompt_details = usage.prompt_tokens_details
    completion_details = usage.completion_tokens_details
    return (
        usage.prompt_tokens,
        usage.completion_tokens,
        (prompt_details.cached_tokens or 0) if prompt_details else 0,
        (prompt_details.cache_write_tokens or 0) if prompt_details else 0,
        (completion_details.reasoning_tokens or 0) if completion_details else 0,
    )


def _usage(turn: Turn) -> dict[str, Any]:
    """The turn's billed totals as an OpenAI ``usage`` object."""
    return _usage_object(turn.usage, *_figures(turn.usage))


def stream_usage_reports(turn: Turn, chunk_count: int) -> tuple[list[dict[str, Any] | None], dict[str, Any] | None]:
    """Where a streamed turn reports usage, by its ``usage_mode`` (R-MA-11).

    ``chunk_count`` is the number of streamed chunks with ``choices``: the
    role chunk, the content chunks and the finish chunk. Returns the usage
    of each of those chunks (None: ``"usage": null``) and the usage of the
    last chunk with empty ``choices`` (None: no such chunk).

    - ``final``: no usage on the chunks; the totals in the last chunk.
    - ``cumulative``: running totals on every chunk — the prompt figures
      from the start, completion figures growing with each content chunk
      (``total * k // n`` after content chunk k of n) — then the totals
      again in the last chunk.
    - ``delta``: increments whose sum is the totals: the prompt figures on
      the role chunk, the completion figures spread over the content chunks
      (the difference of the running totals above), anything left on the
      finish chunk; no last chunk.
    """
    prompt, completion, cached, cache_write, reasoning = _figures(turn.usage)
    content = max(chunk_count - 2, 0)

    def running(total: int, k: int) -> int:
        return total * k // content if content else 0

    if turn.usage_mode == "final":
        return [None] * chunk_count, _usage(turn)
    if turn.usage_mode == "cumulative":
        reports: list[dict[str, Any] | None] = [
            _usage_object(turn.usage, prompt, running(completion, k), cached, cache_write, running(reasoning, k))
            for k in range(chunk_count - 1)  # the role chunk (k = 0), then content chunk k
        ]
        return [*reports, _usage(turn)], _usage(turn)
    reports = [_usage_object(turn.usage, prompt, 0, cached, cache_write, 0)]
    for k in range(1, chunk_count):
        if k <= content:
            step = (
                running(completion, k) - running(completion, k - 1),
                running(reasoning, k) - running(reasoning, k - 1),
            )
        else:  # the finish chunk: what the content chunks did not carry
            step = (completion - running(completion, content), reasoning - running(reasoning, content))
        reports.append(_usage_object(turn.usage, 0, step[0], 0, 0, step[1]))
    return reports, None


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def _deltas(turn: Turn) -> list[dict[str, Any]]:
    """The ``delta`` objects of a streamed turn, first (role) chunk included,
    finish chunk excluded."""
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    deltas += [{"content": piece} for piece in _pieces(turn.text or "", turn.chunk_chars)]
    for index, call in enumerate(turn.tool_calls):
        head = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        deltas.append({"tool_calls": [head]})
        for piece in _pieces(call.arguments_json(), turn.chunk_chars):
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    return deltas


def _message(turn: Turn) -> dict[str, Any]:
    # content is null for a tool-call-only turn, as OpenAI sends it.
    message: dict[str, Any] = {"role": "assistant", "content": turn.text, "refusal": None}
    if turn.tool_calls:
        message["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json()}}
            for call in turn.tool_calls
        ]
    return message


def _sse(payload: dict[str, Any]) -> bytes:
    try:
        body = json.dumps(payload, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        # Lone surrogates (a scenario plays them, R-RUN-11) have no UTF-8
        # form: they travel as \ud83d escapes, as a provider's JSON can.
        body = json.dumps(payload).encode()
    return b"data: " + body + b"\n\n"


async def _stream(turn: Turn, base: dict[str, Any], include_usage: bool) -> AsyncIterator[bytes | _AbortStream]:
    delay = turn.chunk_delay_ms / 1000
    deltas = _deltas(turn)
    # OpenAI sends "usage": null on every chunk when usage was requested;
    # cumulative and delta providers send a usage object instead.
    reports, last_usage = stream_usage_reports(turn, len(deltas) + 1)

    def usage_of(i: int) -> dict[str, Any]:
        return {"usage": reports[i]} if include_usage else {}

    chunks = [
        {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}], **usage_of(i)}
        for i, delta in enumerate(deltas)
    ]
    if turn.fail_after_chunks is not None:
        for chunk in chunks[: turn.fail_after_chunks]:
            if delay:
                await asyncio.sleep(delay)
            yield _sse(chunk)
        yield _ABORT
        return
    if turn.stall_after_chunks is not None:
        for chunk in chunks[: turn.stall_after_chunks]:
            if delay:
                await asyncio.sleep(delay)
            yield _sse(chunk)
        # Hang: nothing more until the client goes away (the response is
        # cancelled then), or the stall's bound passes.
        await asyncio.sleep(STALL_SECONDS)
        yield _ABORT
        return
    chunks.append(
        {
            **base,
            "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": turn.finish_reason}],
            **usage_of(len(deltas)),
        }
    )
    if include_usage and last_usage is not None:
        chunks.append({**base, "choices": [], "usage": last_usage})
    for chunk in chunks:
        if delay:
            await asyncio.sleep(delay)
        yield _sse(chunk)
    yield b"data: [DONE]\n\n"


def build_app(scenarios: dict[str, Scenario]) -> Starlette:
    """The replay server as an ASGI app.

    ``scenarios`` maps scenario names (the ``model`` clients send) to
    scenarios, as returned by :func:`audit.replay.scenarios.load_scenarios`.
    Errors are answered OpenAI-style (``{"error": {"message", "type",
    "code"}}``): 404 ``model_not_found`` for an unknown scenario, 400
    ``scenario_exhausted`` when the turn index is past the last turn, 400
    ``invalid_request`` for a malformed body, the turn's ``http_status`` for
    an error turn, and 500 ``replay_stream_failed`` for a non-streaming
    request to a ``fail_after_chunks`` turn. A turn's
    ``connect_error_times`` and ``fail_before_first_chunk`` apply to the
    first requests of each distinct request (see
    :class:`~audit.replay.scenarios.Turn`), counted in this app.
    """
    seen: dict[str, int] = {}  # request digest -> requests received

    async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "the request body is not valid JSON", code="invalid_request")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object", code="invalid_request")
        name, messages = body.get("model"), body.get("messages")
        if not isinstance(name, str):
            return error_response(400, "'model' must be a scenario name", code="invalid_request")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return error_response(400, "'messages' must be a list of message objects", code="invalid_request")
        found = scenario_turns(scenarios, name)
        if found is None:
            logger.info("replay request: unknown scenario %r", name)
            return error_response(
                404, f"The model '{name}' does not exist: no replay scenario has that name.", code="model_not_found"
            )
        stream = body.get("stream") is True
        index = turn_index(messages)
        logger.info("replay request: scenario=%s turn=%d stream=%s", name, index, stream)
        _, turns = found
        if index >= len(turns):
            return error_response(
                400,
                f"Replay scenario '{name}' has {len(turns)} turn(s); the request asks for turn {index + 1}.",
                code="scenario_exhausted",
            )
        turn = turns[index].played(rejected=rejected_in_turn(messages))
        failing = turn.fail_before_first_chunk
        if turn.connect_error_times or failing is not None:
            digest = _request_digest(name, index, messages)
            seen[digest] = count = seen.get(digest, 0) + 1
            if count <= turn.connect_error_times:
                logger.info(
                    "replay: closing the connection without a response (%d of %d)", count, turn.connect_error_times
                )
                return await _close_connection(request)
            if failing is not None and count <= turn.connect_error_times + failing.times:
                logger.info("replay: answering HTTP %d before the first chunk", failing.status)
                response = error_response(
                    failing.status,
                    failing.error_message or f"replay: HTTP {failing.status} before the first chunk",
                    code="replay_fail_before_first_chunk",
                )
                if failing.retry_after is not None:
                    response.headers["retry-after"] = str(math.ceil(failing.retry_after))
                    response.headers["retry-after-ms"] = str(round(failing.retry_after * 1000))
                return response
        if stream and turn.fail_after_chunks is not None:
            # uvicorn then logs "ASGI callable returned without completing
            # response.": that is this deliberate break, not a bug.
            logger.warning("replay: breaking the stream after %d chunk(s) as the scenario says", turn.fail_after_chunks)
        if turn.http_status is not None:
            return error_response(
                turn.http_status, turn.error_message or f"replay: HTTP {turn.http_status}", code="replay_http_error"
            )
        base = {
            "id": _completion_id(name, index, messages),
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": name,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }
        if stream:
            stream_options = body.get("stream_options") or {}
            include_usage = isinstance(stream_options, dict) and stream_options.get("include_usage") is True
            return _ReplayStreamingResponse(
                _stream(turn, base, include_usage),
                media_type="text/event-stream",
                # The turn's usage mode travels with its stream (R-MA-12).
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", USAGE_MODE_HEADER: turn.usage_mode},
            )
        # Take as long as the stream would have, so slow scenarios are slow
        # for non-streaming clients too.
        chunk_count = len(_deltas(turn)) + 1
        if turn.stall_after_chunks is not None:
            await asyncio.sleep(STALL_SECONDS)
            return error_response(504, "replay: the model stalled", code="replay_stalled")
        if turn.fail_after_chunks is not None:
            await asyncio.sleep(turn.chunk_delay_ms * min(turn.fail_after_chunks, chunk_count) / 1000)
            return error_response(
                500,
                f"replay: the model failed after {turn.fail_after_chunks} chunk(s)",
                code="replay_stream_failed",
            )
        if turn.chunk_delay_ms:
            await asyncio.sleep(turn.chunk_delay_ms * chunk_count / 1000)
        completion = {
            **base,
            "object": "chat.completion",
            "choices": [{"index": 0, "message": _message(turn), "logprobs": None, "finish_reason": turn.finish_reason}],
            "usage": _usage(turn),
        }
        return JSONResponse(completion)

    def _model(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": CREATED, "owned_by": "replay"}

    async def list_models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_model(name) for name in sorted(scenarios)]})

    async def retrieve_model(request: Request) -> JSONResponse:
        name = request.path_params["name"]
        if name not in scenarios:
            return error_response(404, f"The model '{name}' does not exist.", code="model_not_found")
        return JSONResponse(_model(name))

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "scenarios": len(scenarios)})

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{name:path}", retrieve_model, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
        ]
    )


class ReplayServer(uvicorn.Server):
    """A uvicorn server that calls ``on_listening(base_url)`` once its socket
    accepts connections; ``base_url`` is ``http://HOST:PORT/v1`` with the
    port actually bound (useful with port 0)."""

    def __init__(self, config: uvicorn.Config, on_listening: Callable[[str], None] | None = None) -> None:
        super().__init__(config)
        self.on_listening = on_listening
        self.base_url: str | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if not self.started:
            return
        port = self.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://{self.config.host}:{port}/v1"
        if self.on_listening is not None:
            self.on_listening(self.base_url)


def make_server(
    scenarios: dict[str, Scenario],
    host: str = "127.0.0.1",
    port: int = 8765,
    *,
    on_listening: Callable[[str], None] | None = None,
) -> ReplayServer:
    """A :class:`ReplayServer` for ``scenarios`` on ``host``:``port`` (0
    picks a free port), logging one line per request and none per chunk.
    Call ``.run()`` to serve (blocks)."""
    config = uvicorn.Config(
        build_app(scenarios),
        host=host,
        port=port,
        access_log=False,  # build_app logs one line per request itself
        log_config=None,
        lifespan="off",
        timeout_graceful_shutdown=1,
    )
    return ReplayServer(config, on_listening=on_listening)


@contextlib.contextmanager
def serving_in_thread(scenarios: dict[str, Scenario], *, name: str = "replay-model-server") -> Iterator[str]:
    """Serve ``scenarios`` on a free port of 127.0.0.1 from a daemon thread
    of this process while the block runs; yields the base URL
    (``http://127.0.0.1:PORT/v1``) and stops the server at the end. Raises
    ``RuntimeError`` when the server does not start within 10 s."""
    server = make_server(scenarios, "127.0.0.1", 0)
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while server.base_url is None:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("the replay model server did not start")
        time.sleep(0.01)
    try:
        yield server.base_url
    finally:
        server.should_exit = True
        thread.join(timeout=5)


def _announce(base_url: str) -> None:
    print(f"replay model server listening on {base_url}", flush=True)


def serve(
    host: str = "127.0.0.1",
    port: int = 8765,
    scenario_dir: Path | None = None,
    *,
    on_listening: Callable[[str], None] = _announce,
) -> None:
    """Load the scenarios of ``scenario_dir`` (default: the bundled ones)
    and serve them on ``host``:``port`` until interrupted.

    Once the socket accepts connections, ``on_listening`` receives
    ``http://HOST:PORT/v1``; by default one line ``replay model server
    listening on http://HOST:PORT/v1`` is printed to stdout and flushed, so
    scripts can wait for it. Raises :class:`~audit.replay.scenarios.ScenarioError`
    for a malformed scenario file, :class:`NotADirectoryError` for a missing
    directory; uvicorn exits (:class:`SystemExit`) when the port cannot be bound.
    """
    scenarios = load_scenarios(scenario_dir)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr
        )
    server = make_server(scenarios, host, port, on_listening=on_listening)
    server.run()
