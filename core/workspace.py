"""The thread workspace's layout: per-execution files (R-TA-7, R-TA-4).

Every file a tool execution writes into the thread workspace
(``WORKSPACE_ROOT/<thread id>/``) is named after the execution, not after
the tool call id alone: providers number tool calls per response
(``call_0``, ``call_1``), so a later run of the thread may reuse an id, and
a file named by the id would overwrite the earlier run's. An execution is
one audit row, keyed ``(run, role, operation_id)`` (R-TA-1), so its files
live under the run id:

- large results: ``outputs/large_tool_results/<run id>/<tool call id>``
- ``send_email`` records: ``outbox/<run id>/<tool call id>.json``

Files written before this layout stay where they are
(``outputs/large_tool_results/<tool call id>``, ``outbox/<tool call id>.json``)
and stay readable: the States of those runs name the old paths, and readers
of an audit row (:func:`tool_row_large_result_path`) fall back to the old
path when only the old file exists.

A large result's place in the State is :func:`offloaded_summary`: its
size, its path and a preview of :data:`PREVIEW_CHARS` characters; the
agents write it (``audit.agents.large_results``) and the chat history
projects rows the same way (``conversations.selectors``).

Foundation: the tools and agents that write these files, the readers that
name them and the purge that deletes them all use this module; it imports
only the configuration.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from .config import get_config

LARGE_RESULTS_DIR = Path("outputs") / "large_tool_results"
PREVIEW_CHARS = 500
OUTBOX_DIR = Path("outbox")

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_SAFE = re.compile(r"^[A-Za-z0-9_-]{1,120}$")
# The naming of files written before per-execution naming.
_LEGACY_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def execution_file_name(tool_call_id: str) -> str:
    """A file name for one tool call id that can never leave its folder and
    never equals another id's name: a safe id (``[A-Za-z0-9_-]``, 1–120
    characters) is used as it is; any other id becomes its safe characters
    (``_`` for the rest, dots included, at most 80) plus ``-`` and the first
    16 hex digits of its SHA-256, so ``a/b`` and ``a_b`` differ."""
    if _SAFE.match(tool_call_id):
        return tool_call_id
    digest = hashlib.sha256(tool_call_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{_UNSAFE.sub('_', tool_call_id)[:80]}-{digest}"


def _run_dir(run_id: str) -> str:
    if not run_id:
        raise ValueError("a workspace file needs the run id")
    return execution_file_name(str(run_id))


def large_result_path(*, run_id: str, tool_call_id: str) -> Path:
    """Workspace-relative path of one execution's offloaded result:
    ``outputs/large_tool_results/<run id>/<tool call id>`` (R-TA-4, R-TA-7)."""
    return LARGE_RESULTS_DIR / _run_dir(run_id) / execution_file_name(tool_call_id)


def outbox_path(*, run_id: str, tool_call_id: str) -> Path:
    """Workspace-relative path of one ``send_email`` execution's record:
    ``outbox/<run id>/<tool call id>.json`` (R-TA-7)."""
    return OUTBOX_DIR / _run_dir(run_id) / f"{execution_file_name(tool_call_id)}.json"


def legacy_large_result_path(tool_call_id: str) -> Path:
    """Where a large result was written before per-execution naming:
    ``outputs/large_tool_results/<tool call id>`` (unsafe characters as ``_``)."""
    name = _LEGACY_UNSAFE.sub("_", tool_call_id) or "unnamed"
    if name in (".", ".."):
        name = name.replace(".", "_")
    return LARGE_RESULTS_DIR / name


def thread_workspace(thread_id) -> Path:
    """The thread's workspace folder, ``WORKSPACE_ROOT/<thread id>``."""
    return Path(get_config().WORKSPACE_ROOT) / str(thread_id)


def tool_row_large_result_path(*, thread_id, run_id, tool_call_id: str) -> Path:
    """The workspace-relative path of a tool audit row's offloaded result:
    the per-execution path, or — for a result written before per-execution
    naming, whose file is only at the old place — the legacy path, as that
    run's State names it. Looks at the filesystem only to choose the
    fallback."""
    current = large_result_path(run_id=str(run_id), tool_call_id=tool_call_id)
    workspace = thread_workspace(thread_id)
    if (workspace / current).exists():
        return current
    legacy = legacy_large_result_path(tool_call_id)
    if (workspace / legacy).is_file():
        return legacy
    return current


def offloaded_summary(path: Path, preview: str, size_chars: int) -> str:
    """What the graph State (and the agent's memory, and the chat history)
    holds instead of a large result: its size in characters, its
    workspace-relative ``path`` and the first ``PREVIEW_CHARS`` characters
    of ``preview`` (R-TA-4, R-READ-2, R-READ-7)."""
    return (
        f"The result has {size_chars} characters and was saved to the workspace file "
        f"{path.as_posix()}. Preview:\n{preview[:PREVIEW_CHARS]}"
    )
