"""Template helpers of the audit admin (R-ADM-1, R-ADM-2)."""

from __future__ import annotations

import datetime as dt
import re
from html import escape

from django import template
from django.contrib import admin
from django.utils import timezone
from django.utils.safestring import mark_safe

register = template.Library()


def time_text(value: dt.datetime | None, *, zone: dt.tzinfo | None = None) -> str:
    """The one form every time of the admin takes (issue 37), as plain
    text: to the millisecond, with the name of the zone it is shown in
    (``2026-11-30 06:23:41.517 UTC``), in ``zone`` (default: the current
    zone); ``—`` for none; a naive value as it is, without a zone. Not
    escaped: for attributes and text that the caller escapes (the
    waterfall bar's tooltip, R-ADM-1)."""
    if value is None:
        return "—"
    local = local_time(value, zone)
    text = local.isoformat(" ", "milliseconds")[:23]
    name = local.tzname()
    return f"{text} {name}" if name else text


def time_html(value: dt.datetime | None, *, zone: dt.tzinfo | None = None) -> str:
    """:func:`time_text` as HTML (issue 37): the text in a ``<time>``
    element with its exact ISO 8601 form in ``datetime`` and ``title`` for
    copying, in ``zone`` (default: the current zone; a page of many times
    looks it up once and passes it); ``—`` for none."""
    if value is None:
        return "—"
    iso = value.isoformat(timespec="microseconds")
    # format_html's output without its escaping and per-argument checks:
    # the ISO text is digits and "-:.T+ " only, the text is escaped, and a
    # timeline page calls this 1,500 times (issue 11).
    return mark_safe(f'<time datetime="{iso}" title="{iso}">{escape(time_text(value, zone=zone))}</time>')  # noqa: S308


def local_time(value: dt.datetime, zone: dt.tzinfo | None = None) -> dt.datetime:
    """``value`` in ``zone`` (default: the current zone); a naive value as
    it is. Django's ``localtime`` with the check it needs only."""
    if value.utcoffset() is None:
        return value
    return value.astimezone(zone or timezone.get_current_timezone())


def time_column(field: str, description: str, *, ordering: bool = True):
    """An admin display method showing the model's datetime ``field``
    through :func:`time_html` (in place of Django's own date format), under
    ``description``, sortable by the field unless ``ordering`` is false:
    ``created_display = time_column("created_at", "created")``."""

    @admin.display(description=description, ordering=field if ordering else None)
    def show(model_admin, obj):
        return time_html(getattr(obj, field))

    show.__name__ = f"{field}_display"
    return show


# A model name may wrap after the ":" of its provider and after each "-"
# or "/" (``openai:gpt-4o-mini-2024-07-18``), never inside a word.
_MODEL_BREAK = re.compile(r"(?<=[:/-])")
#: Characters of one piece of a model name between those breaks that a
#: list shows; a longer piece is cut with "…" (the title has it whole).
MODEL_PIECE_CHARS = 20


def model_html(name: str) -> str:
    """A model name (``replay:tool_then_answer``) for a narrow list column
    (issue 37): it may wrap only after ``:``, ``-`` or ``/`` (a ``<wbr>``
    there; CSS keeps the rest whole), so a column beside the filters at
    1280 px is as wide as the longest piece, never squeezed to a letter; a
    piece longer than :data:`MODEL_PIECE_CHARS` is cut with "…", and the
    whole name is the element's ``title``."""
    pieces = [
        piece if len(piece) <= MODEL_PIECE_CHARS else piece[: MODEL_PIECE_CHARS - 1] + "…"
        for piece in _MODEL_BREAK.split(name)
    ]
    shown = "<wbr>".join(escape(piece) for piece in pieces if piece)
    return mark_safe(f'<span class="yx-model" title="{escape(name)}">{shown}</span>')  # noqa: S308


@register.filter
def yx_time(value):
    return time_html(value)


@register.filter
def yx_time_text(value):
    return time_text(value)
