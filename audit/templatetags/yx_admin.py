"""Template helpers of the audit admin (R-ADM-1, R-ADM-2)."""

from __future__ import annotations

import datetime as dt

from django import template
from django.utils import timezone
from django.utils.html import format_html

register = template.Library()


_FORMATS = {"full": "%Y-%m-%d %H:%M:%S", "short": "%m-%d %H:%M:%S", "clock": "%H:%M:%S"}


def time_html(value: dt.datetime | None, *, date: bool = True, form: str | None = None) -> str:
    """A time to the millisecond (``2026-11-30 06:23:41.517``; ``form``
    ``short`` drops the year, ``clock`` — or ``date=False`` — the date) in
    the current zone, its exact ISO 8601 form in ``datetime`` and ``title``
    for copying; ``—`` for none."""
    if value is None:
        return "—"
    local = timezone.localtime(value) if timezone.is_aware(value) else value
    pattern = _FORMATS[form or ("full" if date else "clock")]
    text = local.strftime(pattern) + f".{local.microsecond // 1000:03d}"
    iso = value.isoformat(timespec="microseconds")
    return format_html('<time datetime="{}" title="{}">{}</time>', iso, iso, text)


@register.filter
def yx_time(value):
    return time_html(value)


@register.filter
def yx_clock(value):
    return time_html(value, date=False)
