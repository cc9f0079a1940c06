"""Content PostgreSQL cannot store, stored in one documented escaped form
(R-RUN-11).

PostgreSQL refuses two kinds of text that Python strings (and so model
answers, tool arguments and outputs, user input) can hold: U+0000 (``text``
and ``jsonb`` both refuse it) and lone surrogates U+D800–U+DFFF (not
encodable as UTF-8; ``jsonb`` refuses their ``\\u`` escapes too). One such
character used to make an audit write fail with ``DataError`` and the run's
terminal transaction with it.

The escaped form. Every stored string (text columns, and every string and
key inside a JSON value) is written with these characters replaced by a
visible JSON-style escape of six ASCII characters, lowercase hex:

- U+0000 → ``\\u0000``
- a lone surrogate, e.g. U+D83D → ``\\ud83d`` (each surrogate code point
  on its own, so the stored form is exact even for an unpaired one)
- a backslash that would otherwise start one of these escapes (the text
  really contains ``\\u0000``, ``\\u005c`` or ``\\ud800``…``\\udfff``) →
  ``\\u005c``, so the escaped form never meets an ambiguous sequence.

So ``"Hello\\x00world"`` is stored as the 16 characters ``Hello\\u0000world``
and ``{"city": "Par\\x00is"}`` as the jsonb ``{"city": "Par\\\\u0000is"}``.
Text without these characters — practically all text — is stored byte for
byte as given, so SQL searches and exports of ordinary content see it
unchanged. Decoding replaces each of the three escapes by its character in
one left-to-right pass; the encoding is injective, so every value
round-trips exactly (property-tested in ``tests/core/test_storable.py``).

Why escape rather than strip or replace with U+FFFD: nothing the provider
or the user sent is lost, the audit stays exact, and a reader of the raw
table still sees where the character was.

Where it applies: the model fields below (:class:`StorableTextField`,
:class:`StorableCharField`, :class:`StorableJSONField`) escape on every
write (save, create, update, bulk, lookups) and decode on every read
through the ORM, so the services, the recorder and every read path (run
API, history, memory, timeline, SSE rebuilt from the database, admin,
dashboard) see the original value; the JSON APIs and the SSE stream send it
JSON-escaped (``"Hello\\u0000world"``). HTML cannot carry U+0000 or a lone
surrogate, so the admin shows the escaped form (:func:`visible`). Raw SQL
(``psql``, SQL on JSON keys) sees the escaped form; a reader that
measures or cuts a stored text in SQL rather than reading it whole (the
size and head of a tool result in history and memory) uses
:func:`stored_length_sql`/:class:`StoredLength` and
:func:`stored_head_sql`/:class:`StoredHead` with :func:`decode_head`, so it
counts and shows the original's characters (R-RUN-13).

The fields deconstruct as their Django base fields: the escaping is not
schema, and migrations stay plain ``TextField``/``CharField``/``JSONField``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson
from django.db import models

# A character PostgreSQL refuses, or a backslash that would start an escape.
_ESCAPE = re.compile(r"[\x00\ud800-\udfff]|\\(?=u(?:0000|005c|d[89a-f][0-9a-f]{2}))")
_DECODE = re.compile(r"\\u(0000|005c|d[89a-f][0-9a-f]{2})")
# One character class: the fast test that almost every string passes.
_MAYBE = re.compile(r"[\x00\\\ud800-\udfff]")
# An escape inside JSON text: the backslash is itself escaped there.
_JSON_MAYBE_ESCAPED = "\\\\u"


def _escape_char(match: re.Match) -> str:
    return f"\\u{ord(match.group()):04x}"


def _decode_char(match: re.Match) -> str:
    return chr(int(match.group(1), 16))


def escape_text(text: str) -> str:
    """``text`` in the stored form (see the module docstring). Pure, total,
    injective; ``decode_text(escape_text(s)) == s`` for every ``str``."""
    if _MAYBE.search(text) is None:
        return text
    return _ESCAPE.sub(_escape_char, text)


def decode_text(text: str) -> str:
    """The original of a stored string (inverse of :func:`escape_text`)."""
    if "\\u" not in text:
        return text
    return _DECODE.sub(_decode_char, text)


# --------------------------------------------------------------------------
# A stored column's real length and head, read in SQL (R-RUN-13)
# --------------------------------------------------------------------------

# The two templates below are the one definition of both forms: SQL text
# for raw statements (stored_length_sql, stored_head_sql) and Django
# expressions (StoredLength, StoredHead). ``{col}`` is the column, ``{n}``
# the wanted number of real characters (a parameter, cast to integer).
# ``strpos(col, '\u') = 0`` is the cheap test that practically every
# stored text passes: then the stored text is the original, and neither
# template does any regular-expression work.
_SQL_ESCAPE_START = "E'\\\\u'"
# _DECODE as a PostgreSQL regular expression, in an E'' literal so that it
# reads the same whatever standard_conforming_strings says: each escape
# counts as one character, matched left to right as decode_text replaces.
_SQL_DECODE = "E'" + _DECODE.pattern.replace("\\", "\\\\") + "'"
_LENGTH_TEMPLATE = (
    f"(CASE WHEN strpos({{col}}, {_SQL_ESCAPE_START}) = 0 THEN length({{col}}) "
    f"ELSE length(regexp_replace({{col}}, {_SQL_DECODE}, 'x', 'g')) END)"
)
# Each real character takes one or six stored characters, so the first
# 6n stored characters hold at least n whole real characters; an escape
# cut at the end lies beyond them (decode_head cuts it off).
_HEAD_TEMPLATE = (
    f"substr({{col}}, 1, CASE WHEN strpos({{col}}, {_SQL_ESCAPE_START}) = 0 THEN 1 ELSE 6 END * CAST({{n}} AS integer))"
)
_TEMPLATE_PART = re.compile(r"\{(col|n)\}")


def _fill(template: str, parts: dict[str, tuple[str, list]]) -> tuple[str, list]:
    """``template`` with each ``{col}``/``{n}`` replaced by the SQL of
    ``parts[name]`` (``(sql, params)``), and the params in their order."""
    params: list = []

    def part(match: re.Match) -> str:
        sql, part_params = parts[match.group(1)]
        params.extend(part_params)
        return sql

    return _TEMPLATE_PART.sub(part, template), params


def stored_length_sql(column: str) -> str:
    """SQL for the real length in characters of the stored text column
    ``column`` (SQL text without params, e.g. ``conversations_message.content``):
    ``length(decode_text(value))``, counted without reading the value back
    (R-RUN-13). NULL for NULL."""
    return _fill(_LENGTH_TEMPLATE, {"col": (column, [])})[0]


def stored_head_sql(column: str, chars: Any) -> tuple[str, list]:
    """SQL and params for a head of the stored text column ``column`` (SQL
    text without params) that :func:`decode_head` turns into the first
    ``chars`` real characters of the original (``chars`` is the param for
    the count, an int or a stand-in, R-RUN-13). The head is ``chars``
    stored characters when the text holds no escape, else ``6 * chars``."""
    return _fill(_HEAD_TEMPLATE, {"col": (column, []), "n": ("%s", [chars])})


def decode_head(head: str | None, chars: int) -> str | None:
    """The first ``chars`` real characters of the original, from a head read
    by :func:`stored_head_sql` or :class:`StoredHead` with the same
    ``chars`` (R-RUN-13); None stays None."""
    if head is None:
        return None
    if "\\u" in head:
        head = decode_text(head)
    return head[:chars]


class _StoredTextFunc(models.Func):
    """A Django expression of one of the templates above over one text
    expression (a field name or an expression)."""

    _template = ""

    def as_sql(self, compiler, connection, **extra_context):
        column, *rest = self.get_source_expressions()
        parts = {"col": compiler.compile(column)}
        if rest:
            parts["n"] = compiler.compile(rest[0])
        sql, params = _fill(self._template, {name: (part, list(p)) for name, (part, p) in parts.items()})
        return sql, tuple(params)


class StoredLength(_StoredTextFunc):
    """``StoredLength("content")``: the real length in characters of a
    stored text column, as :func:`stored_length_sql` (R-RUN-13); for
    annotations that must not read the whole text."""

    _template = _LENGTH_TEMPLATE
    arity = 1
    output_field = models.IntegerField()


class StoredHead(_StoredTextFunc):
    """``StoredHead("content", chars)``: the head of a stored text column
    that :func:`decode_head` ``(head, chars)`` turns into the first ``chars``
    real characters (``chars`` an int), as :func:`stored_head_sql`
    (R-RUN-13). The value read is the stored form: decode it with
    :func:`decode_head`, never with the field."""

    _template = _HEAD_TEMPLATE
    output_field = models.TextField()

    def __init__(self, expression: Any, chars: int, **extra: Any):
        super().__init__(expression, models.Value(chars), **extra)


def fit_text(text: str, max_length: int) -> str:
    """The longest prefix of ``text`` whose stored form has at most
    ``max_length`` characters: for a :class:`StorableCharField` whose value
    the caller truncates anyway (a thread title), so that escaping never
    pushes it over the column's length."""
    text = text[:max_length]
    while len(escape_text(text)) > max_length:
        # Each escaped character takes six; drop from the end until it fits.
        text = text[: max(0, len(text) - max(1, (len(escape_text(text)) - max_length) // 6))]
    return text


def _map_strings(value: Any, text: Any) -> Any:
    """A copy of a JSON value with ``text`` applied to every string and key;
    numbers, booleans and ``None`` unchanged; other objects pass through."""
    if isinstance(value, str):
        return text(value)
    if isinstance(value, dict):
        return {text(k) if isinstance(k, str) else k: _map_strings(v, text) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(v, text) for v in value]
    return value


def escape_json(value: Any) -> Any:
    """A copy of a JSON value with every string and key escaped; numbers,
    booleans and ``None`` unchanged. Other objects pass through for the
    JSON encoder to handle (or refuse)."""
    return _map_strings(value, escape_text)


def decode_json(value: Any) -> Any:
    """The original of a stored JSON value (inverse of :func:`escape_json`)."""
    return _map_strings(value, decode_text)


# What a model provider's request cannot carry as given: a lone surrogate
# (no UTF-8 encoding: the request is never sent) and U+0000, which
# providers refuse or cut text at.
_UNSENDABLE = re.compile(r"[\x00\ud800-\udfff]")


def sendable_text(text: str) -> str:
    """``text`` as it is sent to a model provider (R-RUN-13): each U+0000
    and each lone surrogate replaced by its six-character escape of the
    stored form (``\\u0000``, ``\\ud83d``), every other character as it
    is (a backslash too: the provider reads the text, it never decodes it).
    So a tool's output, a tool's arguments or an earlier answer holding one
    of them never breaks the next model call, and the model reads where the
    character was. The audit keeps the exact text (:func:`escape_text`)."""
    if _UNSENDABLE.search(text) is None:
        return text
    return _UNSENDABLE.sub(_escape_char, text)


def sendable_json(value: Any) -> Any:
    """A copy of a JSON value (a provider request's payload) with
    :func:`sendable_text` applied to every string and key; a dict or list
    with nothing to replace comes back as it is (not copied). R-RUN-13."""
    if type(value) in (dict, list) and not _may_need_escape(value):
        return value
    return _map_strings(value, sendable_text)


def visible(value: Any) -> Any:
    """For HTML pages: ``value`` (a string or JSON value) in the escaped
    form, which HTML can carry; other values unchanged. A dict or list with
    nothing to escape comes back as it is (not copied)."""
    if type(value) in (dict, list) and not _may_need_escape(value):
        return value
    return escape_json(value)


def _may_need_escape(value: dict | list) -> bool:
    """Whether a string or key anywhere in ``value`` may hold what
    :func:`escape_text` changes (U+0000, a lone surrogate, a backslash),
    answered by one encoding in C instead of a walk in Python: orjson
    writes U+0000 as ``\u0000`` and a backslash as ``\\``, and refuses a
    lone surrogate. Anything it cannot encode itself (a str or dict
    subclass, a Decimal, an integer beyond 64 bits) says "may". For JSON
    values as parsed (dicts, lists, strings, numbers): a tuple inside would
    stay a tuple, where the walk makes it a list."""
    import orjson

    try:
        options = orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_SUBCLASS
        encoded = orjson.dumps(value, default=_refuse, option=options)
    except orjson.JSONEncodeError:
        return True
    return _ENCODED_BACKSLASH in encoded or _ENCODED_NUL in encoded


# How orjson writes a backslash and U+0000 inside a string.
_ENCODED_BACKSLASH = b"\\\\"
_ENCODED_NUL = b"\\u0000"


def _refuse(value: Any) -> Any:
    """orjson's ``default``: the value is not plain JSON; walk it instead.
    Datetimes, UUIDs and numbers orjson writes itself (no string of theirs
    can hold those characters)."""
    raise TypeError(type(value).__name__)


def visible_fields(instance: models.Model) -> models.Model:
    """Put every storable field of a read-only admin object in its escaped
    form, for display (the instance must not be saved afterwards)."""
    for field in instance._meta.concrete_fields:
        if isinstance(field, (StorableTextField, StorableCharField, StorableJSONField)):
            setattr(instance, field.attname, visible(getattr(instance, field.attname)))
    return instance


class _StorableText:
    """Escape on the way in, decode on the way out; migrations see the
    plain Django field named by ``_plain``."""

    _plain = ""

    def get_prep_value(self, value):
        value = super().get_prep_value(value)
        return escape_text(value) if isinstance(value, str) else value

    def from_db_value(self, value, expression, connection):
        return decode_text(value) if isinstance(value, str) else value

    def deconstruct(self):
        name, _, args, kwargs = super().deconstruct()
        return name, self._plain, args, kwargs


class StorableTextField(_StorableText, models.TextField):
    """A ``TextField`` that stores :func:`escape_text` and reads back the
    original (R-RUN-11)."""

    _plain = "django.db.models.TextField"


class StorableCharField(_StorableText, models.CharField):
    """A ``CharField`` that stores :func:`escape_text` and reads back the
    original (R-RUN-11). ``max_length`` applies to the stored form."""

    _plain = "django.db.models.CharField"


_LONG_DIGITS = re.compile(r"[0-9]{19}")


def json_texts_parsed(texts: list[str], *, decoder: type[json.JSONDecoder] | None = None) -> list[Any] | None:
    """``texts`` (JSON documents, as PostgreSQL writes ``jsonb``) parsed by
    one parser call — orjson's; ``json.loads`` with ``decoder``, or where
    a run of 19 digits may be an integer beyond orjson's 64 bits — as a
    list of as many values; ``None`` when they are not one JSON value
    each: the caller then parses them one by one, as the ORM does. For the paged
    readers, where the parser's work per call cost more than the parsing
    (issue 11)."""
    joined = "[" + ",".join(texts) + "]"
    # orjson reads an integer beyond 64 bits as a float: such digits (or
    # any as long, in a string or a fraction) go to json, which keeps them.
    fast = decoder is None and _LONG_DIGITS.search(joined) is None
    try:
        parsed = orjson.loads(joined) if fast else json.loads(joined, cls=decoder)
    except json.JSONDecodeError:  # orjson's error is one too
        return None
    return parsed if type(parsed) is list and len(parsed) == len(texts) else None


class StorableJSONField(models.JSONField):
    """A ``JSONField`` that stores :func:`escape_json` and reads back the
    original (R-RUN-11)."""

    def get_prep_value(self, value):
        return super().get_prep_value(escape_json(value))

    def from_db_value(self, value, expression, connection):
        if isinstance(value, str) and _JSON_MAYBE_ESCAPED not in value:
            return super().from_db_value(value, expression, connection)
        return decode_json(super().from_db_value(value, expression, connection))

    def from_db_values(self, values: list[str], connection) -> list[Any]:
        """:meth:`from_db_value` of each of ``values`` (JSON text as
        PostgreSQL writes ``jsonb``, none null), parsed by one ``json.loads``
        of them all: for a thousand small values (a long thread's declared
        tool calls) the parser's work per call cost more than the parsing.
        Text that is not one JSON value each is read one by one."""
        if not values:
            return []
        parsed = json_texts_parsed(values, decoder=self.decoder)
        if parsed is None:
            return [self.from_db_value(value, None, connection) for value in values]
        return [
            decode_json(value) if _JSON_MAYBE_ESCAPED in text else value
            for text, value in zip(values, parsed, strict=True)
        ]

    def deconstruct(self):
        name, _, args, kwargs = super().deconstruct()
        return name, "django.db.models.JSONField", args, kwargs


def dumps_visible(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of :func:`visible` ``(value)``: JSON for an HTML page."""
    return json.dumps(visible(value), **kwargs)
