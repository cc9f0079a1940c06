"""What a replayed run does differently (R-REPLAY-2).

``python manage.py replay_run`` re-runs an audited turn as new runs of a
scratch thread, executed in its own process
(:mod:`audit.execution.rerun`). Those runs are audit runs like any other —
lease, rows, seal — and differ only in what this module's
:class:`ReplayPlan` says, registered for their run ids while the replay
executes them:

- their ``replay:`` models ask the replay's own model server, which plays
  the exported scenario (``model_url``);
- the first run starts from the recorded turn's history (``history``: the
  thread memory before it), as the audited run did;
- with recorded tools (the default) no tool executes: each call is answered
  with the result the audited turn recorded under its tool call id, and a
  call the turn never made is refused (``tool_results``; None: the tools
  run for real, ``--tools live``);
- a turn that was cancelled is cancelled at the same point: once the model
  call that was cut off has streamed the text it had streamed
  (``cancel_watch``; the replay server stalls there), or when a tool call
  that was cut off starts.

The registry is process-local: a worker that picks up such a run (after the
replay's process died, its lease expired) finds no plan, and the run fails
on its model, which only the replay's server plays.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage

from conversations.selectors import memory_message


@dataclass
class CancelWatch:
    """Where to cancel a replay whose recorded turn was cancelled while a
    model call streamed: the root model call ``step`` (0-based, in the
    order the turn's runs asked the model) once it has streamed ``chars``
    characters of text. Shared by the runs of one replay, which count the
    steps together."""

    step: int
    chars: int
    _steps: list[str] = field(default_factory=list)
    fired: bool = False

    def due(self, operation_id: str, chars: int) -> bool:
        """Whether root model call ``operation_id``, having streamed
        ``chars`` characters, is where to cancel now (True once)."""
        if operation_id not in self._steps:
            self._steps.append(operation_id)
        if self.fired or self._steps.index(operation_id) != self.step or chars < self.chars:
            return False
        self.fired = True
        return True


@dataclass(frozen=True)
class ReplayPlan:
    """How the runs of one replay differ from a worker's runs.

    - ``model_url``: the replay model server's base URL (``http://host:port/v1``).
    - ``history``: memory messages (``{type, id, content, tool_calls,
      tool_call_id, name, status}``, oldest first) the first run starts from.
    - ``history_agent``: the agent that answered in ``history`` (its
      answers carry its name, as a provider was sent them).
    - ``tool_results``: tool call id → ``{content, status, error_type?}``
      (a scenario's recorded results); None to execute the tools.
    - ``cancel_watch``: where the recorded turn was cancelled mid-call.
    """

    model_url: str
    history: tuple[Mapping[str, Any], ...] = ()
    history_agent: str = ""
    tool_results: Mapping[str, Mapping[str, Any]] | None = field(default=None)
    cancel_watch: CancelWatch | None = None

    def history_messages(self) -> list[BaseMessage]:
        """``history`` as LangChain messages, ids kept (they tell the
        recorder which messages came before the run, R-MA-9), answers
        named after ``history_agent`` as the agent named them."""
        messages = [memory_message(item) for item in self.history]
        if self.history_agent:
            for message in messages:
                if isinstance(message, AIMessage):
                    message.name = self.history_agent
        return messages


_plans: dict[uuid.UUID, ReplayPlan] = {}
_lock = threading.Lock()


@contextlib.contextmanager
def replay_plan(run_id: uuid.UUID, plan: ReplayPlan) -> Iterator[None]:
    """Register ``plan`` for run ``run_id`` while the block executes it."""
    with _lock:
        _plans[run_id] = plan
    try:
        yield
    finally:
        with _lock:
            _plans.pop(run_id, None)


def replay_plan_of(run_id: uuid.UUID) -> ReplayPlan | None:
    """The plan registered for run ``run_id`` in this process, or None (a
    worker's run)."""
    with _lock:
        return _plans.get(run_id)
