"""Refuse to serve with settings that are unsafe in production (R-SEC-1).

The web server (ASGI and WSGI entry points) and the Celery workers call
:func:`ensure_safe_settings` before they take any work, as they call the
schema guard (:mod:`yuxi_project.schema_guard`): with ``DEBUG`` off, a
``SECRET_KEY`` that is the public default (or empty) would let anyone forge
session cookies and password reset links, so the process stops with one
line saying what to set. Management commands and tests are not refused:
they sign nothing a browser keeps.
"""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from core.config import INSECURE_SECRET_KEY


class UnsafeSettings(ImproperlyConfigured):
    """A setting that must not reach production (R-SEC-1)."""


def unsafe_settings() -> list[str]:
    """What is unsafe in the loaded settings, one sentence each; empty when
    nothing is (or ``DEBUG`` is on: a developer's own machine)."""
    if settings.DEBUG:
        return []
    problems = []
    if settings.SECRET_KEY in ("", INSECURE_SECRET_KEY):
        problems.append(
            "SECRET_KEY is the public default while DEBUG is off: set SECRET_KEY to 50 or more random characters "
            "(python -c 'import secrets; print(secrets.token_urlsafe(50))'), or DEBUG=true on a developer machine"
        )
    return problems


def start_or_exit(*checks) -> None:
    """Run an entry point's start-up ``checks`` (:func:`ensure_safe_settings`,
    :func:`~yuxi_project.schema_guard.ensure_schema_matches`): a refusal
    (``ImproperlyConfigured``) is printed to stderr as it is, without a
    traceback, and the process exits with status 1 (R-SEC-1, R-SCH-1)."""
    import sys

    for check in checks:
        try:
            check()
        except ImproperlyConfigured as exc:
            print(str(exc), file=sys.stderr, flush=True)
            raise SystemExit(1) from None


def ensure_safe_settings() -> None:
    """Raise :class:`UnsafeSettings` naming every unsafe setting, if any."""
    problems = unsafe_settings()
    if problems:
        raise UnsafeSettings("refusing to start: " + "; ".join(problems))
