"""The drain handler is chained in front of the server's own stop handler
on the application's first call, and hands the signal on (issue 37,
``core.draining``); the end-to-end check is tests/e2e/test_web_drain.py."""

from __future__ import annotations

import asyncio
import signal

import pytest

from core import draining as drain_module
from core.draining import DrainOnStop, draining


@pytest.fixture
def server_handlers():
    """Stand-ins for the server's SIGTERM and SIGINT handlers, restored
    afterwards with the drain flag cleared."""
    seen: list[int] = []
    originals = {number: signal.getsignal(number) for number in drain_module.STOP_SIGNALS}
    for number in drain_module.STOP_SIGNALS:
        signal.signal(number, lambda signum, frame: seen.append(signum))
    yield seen
    for number, handler in originals.items():
        signal.signal(number, handler)
    drain_module._draining.clear()


def test_the_first_call_chains_the_drain_in_front_of_the_servers_handler(server_handlers):
    calls = []

    async def inner(scope, receive, send):
        calls.append(scope["type"])

    application = DrainOnStop(inner)
    asyncio.run(application({"type": "http"}, None, None))
    asyncio.run(application({"type": "http"}, None, None))
    assert calls == ["http", "http"]
    assert not draining()

    signal.raise_signal(signal.SIGTERM)

    assert draining()
    # The server's own handler still runs, once: chained once, not per call.
    assert server_handlers == [signal.SIGTERM]


def test_before_the_first_call_a_signal_reaches_only_the_server(server_handlers):
    DrainOnStop(None)
    signal.raise_signal(signal.SIGINT)
    assert not draining()
    assert server_handlers == [signal.SIGINT]
