"""Which URLs a run may announce its end to (R-API-3).

A ``webhook`` is checked when a run is submitted or resumed, and again
before every delivery attempt (the allowed hosts may have changed since):
the product sends requests only to hosts an operator listed, never to an
address a client chose.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from core.config import get_config
from core.errors import InvalidInput

from .errors import WebhookNotAllowed

MAX_URL_LENGTH = 2000
# Scheme, host (no user, password, brackets or spaces), an optional port of
# 0-65535, then anything without spaces or control characters. The API
# schema's ``webhook`` pattern (audit.schemas); a URL that matches it is
# one urllib splits without error. White space is listed, not ``\s``:
# JavaScript's, Python's and pydantic's ``\s`` differ (U+0085, U+FEFF),
# and the schema, pydantic and this module must agree.
_NOT_VISIBLE = r"\x00-\x20\x7f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
_PORT = r"(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[0-9]{1,4})"
URL_PATTERN = rf"^[Hh][Tt][Tt][Pp][Ss]?://[^{_NOT_VISIBLE}/?#@:\[\]\\]+(?::{_PORT})?(?:[/?#][^{_NOT_VISIBLE}]*)?$"
_URL = re.compile(URL_PATTERN)


def host_allowed(host: str, allowed: list[str]) -> bool:
    """Whether ``host`` (lower case) matches an entry of ``allowed``: the
    same name, or for an entry ``.example.com`` that domain or any of its
    subdomains (as Django's ``ALLOWED_HOSTS``)."""
    for entry in allowed:
        if entry.startswith("."):
            if host == entry[1:] or host.endswith(entry):
                return True
        elif host == entry:
            return True
    return False


def receiver_of(url: str) -> str:
    """The receiver of ``url``: its scheme, host and port in lower case
    (``https://hooks.example.com:443``), the unit a delivery pass isolates
    (a receiver that fails is not tried again in the same pass). ``""`` for
    a URL that does not split (an erased one)."""
    try:
        parts = urlsplit(url)
        scheme, host, port = parts.scheme.lower(), (parts.hostname or "").lower(), parts.port
    except ValueError:
        return ""
    if not host or scheme not in ("http", "https"):
        return ""
    return f"{scheme}://{host}:{port or (443 if scheme == 'https' else 80)}"


def webhook_checked(url: str) -> str:
    """``url`` if the product may POST to it, unchanged.

    Args:
        url: an absolute ``http://`` or ``https://`` URL (:data:`URL_PATTERN`:
            a host, an optional port, no user or password, no spaces or
            control characters; at most :data:`MAX_URL_LENGTH` characters)
            whose host is allowed by ``WEBHOOK_ALLOWED_HOSTS``.

    Raises:
        InvalidInput: not such a URL (422, ``reason: bad_webhook``); the
            API schema refuses the same.
        WebhookNotAllowed: a host outside ``WEBHOOK_ALLOWED_HOSTS``, or
            webhooks not configured (``WEBHOOK_ALLOWED_HOSTS`` or
            ``WEBHOOK_SECRET`` unset): 403, ``reason`` ``host_not_allowed``
            or ``not_configured``.

    Implements R-API-3.
    """
    if len(url) > MAX_URL_LENGTH or not _URL.fullmatch(url):
        raise InvalidInput(
            f"webhook must be an http:// or https:// URL with a host, an optional port and no user or password, "
            f"at most {MAX_URL_LENGTH} characters",
            extra={"reason": "bad_webhook"},
        )
    config = get_config()
    if not config.WEBHOOK_ALLOWED_HOSTS or not config.WEBHOOK_SECRET:
        raise WebhookNotAllowed(
            "webhooks are not configured on this server (WEBHOOK_ALLOWED_HOSTS and WEBHOOK_SECRET)",
            extra={"reason": "not_configured"},
        )
    try:
        host = (urlsplit(url).hostname or "").lower()
    except ValueError:  # a host that NFKC-normalises to a delimiter: no allowed host
        host = ""
    if not host_allowed(host, config.WEBHOOK_ALLOWED_HOSTS):
        raise WebhookNotAllowed(
            f"webhook host {host!r} is not in WEBHOOK_ALLOWED_HOSTS", extra={"reason": "host_not_allowed"}
        )
    return url
