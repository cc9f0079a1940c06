"""``docs/configuration.md``, rendered from :class:`core.config.Config`.

The page is the class: every field's name, type, constraints, default and
``description``, in declaration order, under the section headings of
:data:`SECTIONS`. ``manage.py config_reference --write docs/configuration.md``
writes it, and ``tests/core/test_config_reference.py`` fails when the committed
page differs from :func:`render`, so the reference cannot drift from the code.
"""

from __future__ import annotations

import types
import typing
from decimal import Decimal
from pathlib import Path

import annotated_types
from pydantic.fields import FieldInfo

from core.config import BASE_DIR, Config

# A section starts at the field named here and runs to the next section's
# first field, so a field added anywhere lands in the section around it.
SECTIONS: tuple[tuple[str, str], ...] = (
    ("Services", "DATABASE_URL"),
    ("Django", "SECRET_KEY"),
    ("Models", "MODELS"),
    ("Runs, leases and dispatch", "LEASE_TTL_SECONDS"),
    ("Tools, live events and the dashboard", "LARGE_TOOL_RESULT_CHARS"),
    ("Cost and budgets", "MODEL_PRICES"),
    ("Operations", "METRICS_TOKEN"),
    ("OpenTelemetry export", "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ("Retention", "RETENTION_DAYS"),
)

HEADER = """\
# Configuration

Every setting of the product, for whoever deploys it. All settings come from
the environment and are validated at start-up (`core/config.py`): a
malformed value stops the process with a `ConfigError` naming the variable.

This page is generated from the settings class: edit the class's field, then
run `.venv/bin/python manage.py config_reference --write docs/configuration.md`
(a test fails while the two differ).
"""

SCRIPTS = """\
## Variables of the scripts

Read by `bin/quickstart` and `bin/test`, not by the product:

| variable | default | meaning |
|---|---|---|
| `PORT` | `8000` | the web server's port (`bin/quickstart`) |
| `REPLAY_PORT` | `8765` | the replay model server's port (`bin/quickstart`; it sets `REPLAY_MODEL_URL` to match) |
| `LOG_DIR` | `var/log` | the processes' logs (`bin/quickstart`) |
| `EMBEDDED_PGDATA` | `var/pgdata` | the embedded PostgreSQL's data directory, when `DATABASE_URL` does not answer (`bin/quickstart`) |
| `PYTHON` | `python3.12` or `python3.13` found on the PATH or under pyenv | the interpreter that creates `.venv` (both scripts) |
"""


class SectionsError(RuntimeError):
    """:data:`SECTIONS` names a field the settings class does not have."""


def _type(annotation: object) -> str:
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(arg) for arg in typing.get_args(annotation) if arg is not type(None))
    if origin is typing.Literal:
        return " / ".join(f"`{value}`" for value in typing.get_args(annotation))
    if origin is list:
        return "comma-separated list"
    if origin is dict:
        return "JSON object"
    names = {str: "text", bool: "`true` / `false`", int: "integer", float: "number", Decimal: "decimal", Path: "path"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _bounds(field: FieldInfo) -> str:
    parts = []
    for item in field.metadata:
        for attribute, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            value = getattr(item, attribute, None)
            if isinstance(item, annotated_types.BaseMetadata) and value is not None:
                parts.append(f"{sign} {_number(value)}")
    return ", ".join(parts)


def _number(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _default(value: object) -> str:
    if value is None or value == "":
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, Path):
        return f"`{value.relative_to(BASE_DIR)}`" if value.is_relative_to(BASE_DIR) else f"`{value}`"
    if isinstance(value, list):
        return f"`{','.join(value)}`" if value else "none"
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{value}`"
    return f"`{_number(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """The whole page as Markdown (str, ending in one newline).

    Raises :class:`SectionsError` when :data:`SECTIONS` names a field that
    is gone, so a renamed setting cannot silently merge two sections.
    """
    fields = Config.model_fields
    starts = {first: title for title, first in SECTIONS}
    missing = sorted(set(starts) - set(fields))
    if missing:
        raise SectionsError(f"SECTIONS names fields Config does not have: {', '.join(missing)}")
    lines = [HEADER.rstrip("\n")]
    for name, field in fields.items():
        if name in starts:
            lines += ["", f"## {starts[name]}", "", "| variable | type | default | meaning |", "|---|---|---|---|"]
        kind = _type(field.annotation)
        bounds = _bounds(field)
        if bounds:
            kind = f"{kind}, {bounds}"
        lines.append(
            f"| `{name}` | {_cell(kind)} | {_cell(_default(field.get_default(call_default_factory=True)))} | {_cell(field.description or '')} |"
        )
    lines += ["", SCRIPTS]
    return "\n".join(lines).rstrip("\n") + "\n"
