"""Run, thread, request and worker ids on every log line (R-OPS-1).

Code keeps logging through the standard library (``logging.getLogger``).
The ids live in one context variable: the request middleware
(:mod:`ops.middleware`) binds ``request_id`` (and the ``run_id`` /
``thread_id`` of the URL), the worker binds ``run_id``, ``thread_id`` and
``worker`` (the lease owner) when it takes a run. Context variables follow
asyncio tasks and ``sync_to_async`` threads, so every line logged inside the
request or the run carries them. :class:`ContextFilter`, installed on the
log handler, copies them onto each record; the formatter — plain text by
default, JSON lines with ``LOG_FORMAT=json`` — prints them.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import socket
from collections.abc import Iterator
from typing import Any

FIELDS = ("run_id", "thread_id", "request_id", "worker")

_context: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("yuxi_log_context", default={})  # noqa: B039


def process_identity() -> str:
    """``host:pid``: the ``worker`` of a line logged outside a run."""
    return f"{socket.gethostname()}:{os.getpid()}"


def bind(**values: Any) -> None:
    """Add ids to the current context (``None`` values are skipped), for the
    rest of the current task, thread or :func:`scope`."""
    _context.set({**_context.get(), **{key: str(value) for key, value in values.items() if value is not None}})


def start(**values: Any) -> None:
    """Replace the current ids with ``values`` (a new request begins)."""
    _context.set({key: str(value) for key, value in values.items() if value is not None})


@contextlib.contextmanager
def scope(**values: Any) -> Iterator[None]:
    """A fresh context for one task or request: ids bound inside are gone
    afterwards (a Celery child or a WSGI thread serves many)."""
    token = _context.set({key: str(value) for key, value in values.items() if value is not None})
    try:
        yield
    finally:
        _context.reset(token)


def current() -> dict[str, str]:
    """The ids bound now."""
    return dict(_context.get())


class ContextFilter(logging.Filter):
    """Sets ``run_id``, ``thread_id``, ``request_id`` and ``worker`` on every
    record (``None`` when not bound; ``worker`` defaults to ``host:pid``).
    Values a caller passed with ``extra=`` win."""

    def filter(self, record: logging.LogRecord) -> bool:
        bound = _context.get()
        for field in FIELDS:
            if getattr(record, field, None) is None:
                setattr(record, field, bound.get(field))
        if record.worker is None:
            record.worker = process_identity()
        return True


def json_formatter(**_kwargs: Any) -> logging.Formatter:
    """One JSON object per line: ``time``, ``level``, ``logger``,
    ``message``, the four ids, and ``exc_info`` when there is one
    (python-json-logger). Used by ``LOGGING`` when ``LOG_FORMAT=json``."""
    from pythonjsonlogger.json import JsonFormatter

    return JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s %(run_id)s %(thread_id)s %(request_id)s %(worker)s",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
    )
