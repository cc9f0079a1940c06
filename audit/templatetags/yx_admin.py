"""Template helpers of the audit admin (R-ADM-1, R-ADM-2)."""

from __future__ import annotations

import datetime as dt

from django import template
from django.utils import timezone
from django.utils.safestring import mark_safe

register = template.Library()


# Where each form lies in ``isoformat(" ", "milliseconds")``
# (``2026-11-30 06:23:41.517+08:00``).
_FORMS = {"full": slice(0, 23), "short": slice(5, 23), "clock": slice(11, 23)}


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
    local = local_time(value, zone)
    text = local.isoformat(" ", "milliseconds")[_FORMS[form or ("full" if date else "clock")]]
    iso = value.isoformat(timespec="microseconds")
    # format_html's output without its escaping and per-argument checks:
    # both texts are digits and "-:.T+ " only, and a timeline page calls
    # this 1,500 times (issue 11).
    return mark_safe(f'<time datetime="{iso}" title="{iso}">{text}</time>')  # noqa: S308


def local_time(value: dt.datetime, zone: dt.tzinfo | None = None) -> dt.datetime:
    """``value`` in ``zone`` (default: the current zone); a naive value as
    it is. Django's ``localtime`` with the check it needs only."""
    if value.utcoffset() is None:
        return value
    return value.astimezone(zone or timezone.get_current_timezone())


@register.filter
def yx_time(value):
    return time_html(value)


@register.filter
def yx_clock(value):
    return time_html(value, date=False)
