"""Template helpers of the audit admin (R-ADM-1, R-ADM-2)."""

from __future__ import annotations

import datetime as dt
from html import escape

from django import template
from django.utils import timezone
from django.utils.safestring import mark_safe

register = template.Library()


_FORMATS = {"full": "%Y-%m-%d %H:%M:%S", "short": "%m-%d %H:%M:%S", "clock": "%H:%M:%S"}


def time_html(
    value: dt.datetime | None, *, date: bool = True, form: str | None = None, zone: dt.tzinfo | None = None
) -> str:
    """A time to the millisecond (``2026-11-30 06:23:41.517``; ``form``
    ``short`` drops the year, ``clock`` — or ``date=False`` — the date) in
    ``zone`` (default: the current zone; a page of many times looks it up
    once and passes it), its exact ISO 8601 form in ``datetime`` and
    ``title`` for copying; ``—`` for none."""
    if value is None:
        return "—"
    local = timezone.localtime(value, zone) if timezone.is_aware(value) else value
    pattern = _FORMATS[form or ("full" if date else "clock")]
    text = escape(local.strftime(pattern) + f".{local.microsecond // 1000:03d}")
    iso = escape(value.isoformat(timespec="microseconds"))
    # format_html's output, without its per-argument lazy-string checks:
    # a timeline page calls this 1,500 times (issue 11).
    return mark_safe(f'<time datetime="{iso}" title="{iso}">{text}</time>')  # noqa: S308


@register.filter
def yx_time(value):
    return time_html(value)


@register.filter
def yx_clock(value):
    return time_html(value, date=False)
