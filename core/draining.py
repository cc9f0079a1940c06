"""The web process's drain: a stop signal ends the live event streams.

uvicorn's graceful shutdown waits for every open response to end, and a
live event stream (``GET /api/runs/{id}/events``) ends only when its run
does: a web server asked to stop while clients follow runs waited for
every followed run (issue 37). :class:`DrainOnStop` wraps the ASGI
application and, on its first call, puts a handler in front of the
server's own for SIGTERM and SIGINT (:func:`drain_on_signals`): it marks
the process as draining and hands the signal on. Each stream looks at
:func:`draining` between its waits (``audit.execution.events``, at most
``block_ms`` apart) and ends; the client reconnects with ``Last-Event-ID``
to another server (or this one restarted) and misses nothing (R-EVT-1).

The handler is chained on the first call, not at import: uvicorn imports
the application before it installs its own handlers, and would replace a
handler installed at import until it exits.
"""

from __future__ import annotations

import signal
import threading

_draining = threading.Event()

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def draining() -> bool:
    """Whether this process was asked to stop."""
    return _draining.is_set()


def begin_draining() -> None:
    """Mark the process as stopping: live streams end at their next wait."""
    _draining.set()


def drain_on_signals() -> bool:
    """Chain :func:`begin_draining` in front of the handlers now installed
    for :data:`STOP_SIGNALS`. Returns False where signals cannot be
    handled (not the main thread): the streams then end with their runs,
    as before."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for number in STOP_SIGNALS:
        previous = signal.getsignal(number)

        def handler(signum, frame, previous=previous):
            begin_draining()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)

        signal.signal(number, handler)
    return True


class DrainOnStop:
    """ASGI middleware: chains the drain handler (:func:`drain_on_signals`)
    on its first call, once the server has installed its own handlers
    (the lifespan startup, or the first request with ``--lifespan off``),
    and otherwise passes every call through unchanged."""

    def __init__(self, application):
        self.application = application
        self._chained = False

    async def __call__(self, scope, receive, send):
        if not self._chained:
            self._chained = True
            drain_on_signals()
        return await self.application(scope, receive, send)
