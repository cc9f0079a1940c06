"""Replay an audited turn and report where it diverged (R-REPLAY-2).

:func:`replay` takes a scenario exported from the audit
(:func:`audit.replay.export.export_scenario`, or its file) and runs the
turn again, here, in this process:

1. a replay model server in a thread of this process plays the scenario
   (its model calls, in order, failures included);
2. a scratch thread of the replay user (:data:`REPLAY_USERNAME`, who
   cannot sign in) gets the turn's input, starting from the recorded
   history; each run is created and leased in one transaction and
   executed here (:func:`~audit.execution.runner.run_execute_acquired`),
   so no worker starts it; every resume of the recorded turn is answered
   with its recorded decisions;
3. tools answer from the recorded results (no tool executes; a call the
   turn never made is refused), or run for real with ``tools="live"``;
4. the replayed turn is exported the same way and compared with the
   recorded one, step by step (:func:`compare`).

The replayed runs are audit runs like any other: leased, recorded, sealed;
each says what it replays (``AgentRun.replay_of``: the recorded run, also
for a scenario file), so that no dashboard figure or user statistic counts it
and the admin marks it (issue 34).
What the comparison reads, per model call in order: the request the
agent sent (its fingerprint: system prompt, tools offered, conversation),
the tool calls declared (name, arguments), the text, the failure, the
usage; per tool call, the result; at the end, how many runs the turn took
and how the last one ended.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from xml.etree import ElementTree

from celery import current_app
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from conversations.models import Conversation
from core.config import get_config
from core.errors import ApplicationError, NotFound

from .. import ledger
from ..catalogue import validate_agent_id
from ..ledger.runs import run_acquire_with_row
from ..models import AgentRun, RunReplay
from ..replay.export import RunNotFound, export_scenario, validate
from ..replay.scenarios import Scenario, ScenarioError, Turn, load_scenario
from ..replay.server import serving_in_thread
from .fingerprint import mask_run_paths
from .replay_plans import CancelWatch, ReplayPlan, replay_plan
from .runner import run_execute_acquired

log = logging.getLogger(__name__)

REPLAY_USERNAME = "yuxi-replay"
"""The user who owns every replayed run's thread: inactive, without a
usable password, so nobody signs in as it."""

REPLAY_OWNER = "replay"
"""The lease owner of a replayed run (its worker identity)."""

ToolsMode = Literal["recorded", "live"]


class ReplaySourceError(ValueError):
    """What was given to replay is not a run or a scenario a replay can
    play: an unknown run, an unreadable file, a scenario without its
    ``recorded`` section (a hand-written one), or one that recorded no
    input."""


@dataclass(frozen=True)
class Divergence:
    """One difference between the recorded turn and its replay: ``where``
    (``step 2``, ``subagent fact_checker step 1``, ``tool call <id>``,
    ``end``), ``what`` differs and both values."""

    where: str
    what: str
    expected: Any
    got: Any

    def lines(self) -> list[str]:
        return [
            f"{self.where}: {self.what}",
            f"  expected: {_show(self.expected)}",
            f"  got:      {_show(self.got)}",
        ]


@dataclass
class ReplayReport:
    """The outcome of :func:`replay`: what was replayed (``source``, the
    agent, the tools mode), the scratch thread and replayed runs, how many
    model calls and tool results were compared, and the differences in
    the order they happened (``divergences``; empty when identical)."""

    source: str
    agent_id: str
    tools: str
    thread_id: str = ""
    run_ids: list[str] = field(default_factory=list)
    steps: int = 0
    tool_results: int = 0
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not self.divergences

    def text(self) -> str:
        """The report as text lines: the header, then ``IDENTICAL`` or
        ``DIVERGED`` with the first difference and the others."""
        head = [
            f"replay of {self.source} (agent {self.agent_id}, tools {self.tools})",
            f"  scratch thread {self.thread_id}, runs {', '.join(self.run_ids) or '-'}",
            f"  compared {self.steps} model call(s) and {self.tool_results} tool result(s)",
        ]
        if self.identical:
            return "\n".join([*head, "IDENTICAL"]) + "\n"
        first, *rest = self.divergences
        body = [f"DIVERGED at {first.where}", *first.lines()]
        if rest:
            body.append(f"and {len(rest)} more difference(s) after it:")
            for each in rest[:20]:
                body.extend(f"  {line}" for line in each.lines())
        return "\n".join([*head, *body]) + "\n"

    def junit_xml(self) -> str:
        """The report as a JUnit XML document: one test case named after
        the source, failed with the report when the replay diverged."""
        suite = ElementTree.Element(
            "testsuite", name="replay_run", tests="1", failures="0" if self.identical else "1", errors="0"
        )
        case = ElementTree.SubElement(suite, "testcase", classname="replay_run", name=self.source)
        if not self.identical:
            first = self.divergences[0]
            failure = ElementTree.SubElement(case, "failure", message=f"diverged at {first.where}: {first.what}")
            failure.text = self.text()
        ElementTree.SubElement(case, "system-out").text = self.text()
        return ElementTree.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"


def load_source(source: str) -> Scenario:
    """The scenario to replay from ``source``: a run id (its whole turn,
    the first run and every resume, exported from the audit) or the path
    of a scenario file written by ``export_scenario``.

    Raises :class:`ReplaySourceError` when it is neither, or when the
    scenario has no ``recorded`` section."""
    path = Path(source)
    try:
        uuid.UUID(source)
        is_run_id = not path.exists()
    except ValueError:
        is_run_id = False
    if is_run_id:
        try:
            scenario = validate(export_scenario(source), "replayed")
        except (RunNotFound, ValueError) as exc:  # or nothing to export
            raise ReplaySourceError(str(exc)) from exc
    elif not path.exists():
        raise ReplaySourceError(f"{source}: neither a run id nor a scenario file")
    else:
        try:
            scenario = load_scenario(path)
        except ScenarioError as exc:
            raise ReplaySourceError(f"{source}: {exc.problem}") from exc
    if scenario.recorded is None:
        raise ReplaySourceError(
            f"{source}: the scenario has no 'recorded' section: replay a run, or a file written by export_scenario"
        )
    if not scenario.recorded.input:
        raise ReplaySourceError(f"{source}: the scenario records no input to replay")
    return scenario


def replay(
    scenario: Scenario, *, source: str = "", agent_id: str | None = None, tools: ToolsMode = "recorded"
) -> ReplayReport:
    """Run the turn ``scenario`` recorded again and compare (see the module
    docstring). ``agent_id`` replays it on another agent than the recorded
    one; ``tools="live"`` executes the tools instead of answering from the
    recorded results.

    Returns the :class:`ReplayReport`. Raises :class:`ReplaySourceError`
    for a scenario without ``recorded``, and ``UnknownAgent`` for an
    unknown agent id (before anything is created).

    Implements R-REPLAY-2.
    """
    recorded = scenario.recorded
    if recorded is None:
        raise ReplaySourceError("the scenario has no 'recorded' section")
    if tools not in ("recorded", "live"):
        raise ValueError(f"tools must be 'recorded' or 'live', not {tools!r}")
    agent = validate_agent_id(agent_id or recorded.agent_id)
    report = ReplayReport(source=source or scenario.name, agent_id=agent, tools=tools)
    # The server plays the scenario under a name of its own: a model name
    # no worker's server knows.
    name = f"replay-{uuid.uuid4().hex[:12]}"
    played = scenario.model_copy(update={"name": name})
    tool_results = (
        None if tools == "live" else {call_id: result.model_dump() for call_id, result in recorded.tool_results.items()}
    )
    with serving_in_thread({name: played}, name="replay-run-model-server") as url:
        plan = ReplayPlan(
            model_url=url,
            history=tuple(recorded.history),
            history_agent=recorded.agent_id,
            tool_results=tool_results,
            cancel_watch=_cancel_watch(scenario),
        )
        thread = Conversation(
            user=replay_user(), agent_id=agent, model=f"replay:{name}", title=f"Replay of {report.source}"[:200]
        )
        # The recorded run, also when the scenario came from a file: what
        # the replay copied of it is found (and erased) with it (R-GOV-2).
        refused = _play_turn(thread, recorded, plan, report, replay_of=recorded.run_ids[-1])
    last = AgentRun.objects.get(pk=report.run_ids[-1])
    try:
        got = validate(export_scenario(last.id), name)
    except ValueError:  # the replay made no model call at all
        report.divergences = [*refused, *_nothing_asked(scenario, last)]
        report.steps, report.tool_results = len(scenario.turns), len(recorded.tool_results)
        return report
    report.divergences = [*refused, *compare(scenario, got, report)]
    return report


def _nothing_asked(expected: Scenario, run: AgentRun) -> list[Divergence]:
    """The differences of a replay whose run asked the model nothing (its
    agent failed to start, its budget refused the call)."""
    recorded = expected.recorded
    assert recorded is not None
    found = [Divergence("step 1", "model call", _summary(expected.turns[0]), "no model call")]
    if (recorded.status, recorded.error_type) != (run.status, run.error_type):
        found.append(
            Divergence(
                "end",
                "status",
                f"{recorded.status} {recorded.error_type}".strip(),
                f"{run.status} {run.error_type}".strip(),
            )
        )
    return found


class ReplayDiverged(AssertionError):
    """Raised by :func:`assert_replays_identical`: the replay diverged.
    ``report`` is the :class:`ReplayReport`; ``str(error)`` its text."""

    def __init__(self, report: ReplayReport):
        super().__init__(report.text())
        self.report = report


def assert_replays_identical(
    source: str | Path, *, agent_id: str | None = None, tools: ToolsMode = "recorded"
) -> ReplayReport:
    """The pytest helper: replay ``source`` (a run id, or the path of a
    scenario file written by ``export_scenario``) and return the report
    when it is identical. Needs the database (a ``django_db(transaction=True)``
    test: the replay commits its runs as a worker would).

    Raises :class:`ReplayDiverged` (an ``AssertionError``, so pytest shows
    the report) when it diverged, :class:`ReplaySourceError` when the
    source cannot be replayed. Implements R-REPLAY-2."""
    text = str(source)
    report = replay(load_source(text), source=text, agent_id=agent_id, tools=tools)
    if not report.identical:
        raise ReplayDiverged(report)
    return report


def scenario_files(directory: str | Path) -> list[Path]:
    """The ``*.json`` scenario files of ``directory``, sorted: the values
    for ``@pytest.mark.parametrize`` over a folder of recorded turns
    (R-REPLAY-2). Raises ``NotADirectoryError`` for a missing folder (a
    misspelt path must not make an empty, passing test run)."""
    folder = Path(directory)
    if not folder.is_dir():
        raise NotADirectoryError(f"no scenario folder {folder}")
    return sorted(folder.glob("*.json"))


REPLAY_RUN_TASK = "audit.replay_run"
"""The worker's task that runs a replay asked for from the admin
(:func:`replay_requested_run`), sent by name."""


def replay_request(*, run_id: uuid.UUID, user: Any) -> RunReplay:
    """Ask for a replay of the turn of run ``run_id`` (all its runs) on
    behalf of ``user`` (a staff member, from the admin): a ``pending``
    :class:`RunReplay`, handed to a worker after commit (tools answered
    from the recorded results: an admin replay never executes a tool).

    Raises ``NotFound`` for an unknown run. Implements R-REPLAY-2."""
    run = AgentRun.objects.filter(pk=run_id).only("id").first()
    if run is None:
        raise NotFound("run not found")
    with transaction.atomic():
        request = RunReplay.objects.create(run=run, requested_by=user)
        transaction.on_commit(lambda: _enqueue_replay(request.id))
    return request


def _enqueue_replay(replay_id: uuid.UUID) -> None:
    """Hand a requested replay to a worker (embedded: a thread of this
    process). A broker that does not take it ends the request ``failed``,
    saying so: nothing waits for a message that was never sent."""
    if REPLAY_RUN_TASK not in current_app.tasks:
        current_app.loader.import_default_modules()
    task = current_app.tasks[REPLAY_RUN_TASK]
    if getattr(settings, "CELERY_TASK_ALWAYS_EAGER", False):
        threading.Thread(target=task.apply, args=((str(replay_id),),), name=f"replay-{replay_id}", daemon=True).start()
        return
    try:
        current_app.send_task(REPLAY_RUN_TASK, args=(str(replay_id),))
    except Exception as exc:  # kombu OperationalError, redis errors, timeouts
        log.warning("replay %s not enqueued: %s: %s", replay_id, type(exc).__name__, exc)
        RunReplay.objects.filter(pk=replay_id, status=RunReplay.Status.PENDING).update(
            status=RunReplay.Status.FAILED,
            finished_at=timezone.now(),
            first_divergence=f"not handed to a worker: {type(exc).__name__}: {exc}"[:500],
        )


def replay_requested_run(replay_id: uuid.UUID | str) -> str:
    """Run the replay ``replay_id`` asked for with :func:`replay_request`
    and store its outcome (``identical``, ``diverged``, or ``failed`` with
    the reason), the first divergence, the report and the replayed runs.
    A request already taken (a second delivery) is left alone. Returns the
    request's status. Implements R-REPLAY-2."""
    taken = RunReplay.objects.filter(pk=replay_id, status=RunReplay.Status.PENDING).update(
        status=RunReplay.Status.RUNNING
    )
    request = RunReplay.objects.get(pk=replay_id)
    if not taken:
        return request.status
    fields: dict[str, Any] = {"finished_at": None}
    try:
        report = replay(load_source(str(request.run_id)), source=str(request.run_id))
    except (ReplaySourceError, ApplicationError) as exc:
        fields.update(status=RunReplay.Status.FAILED, first_divergence=str(exc)[:500])
    except Exception as exc:  # the replay itself broke: say so on the request
        log.exception("replay %s of run %s failed", replay_id, request.run_id)
        fields.update(status=RunReplay.Status.FAILED, first_divergence=f"{type(exc).__name__}: {exc}"[:500])
    else:
        fields.update(_outcome(report))
    fields["finished_at"] = timezone.now()
    RunReplay.objects.filter(pk=replay_id).update(**fields)
    return fields["status"]


def _outcome(report: ReplayReport) -> dict[str, Any]:
    """The :class:`RunReplay` fields that a finished replay fills."""
    first = report.divergences[0] if report.divergences else None
    return {
        "status": RunReplay.Status.IDENTICAL if first is None else RunReplay.Status.DIVERGED,
        "first_divergence": "" if first is None else f"{first.where}: {first.what}"[:500],
        "report": report.text(),
        "replay_run_ids": report.run_ids,
    }


def record_replay(report: ReplayReport, recorded_run_id: str) -> RunReplay | None:
    """Keep a replay made outside the admin (``replay_run``) on the
    recorded run's page, as one asked for there: a finished
    :class:`RunReplay` with nobody as its requester. None when the
    recorded run is not in this audit (a scenario file from elsewhere)."""
    try:
        run = AgentRun.objects.filter(pk=uuid.UUID(str(recorded_run_id))).only("id").first()
    except ValueError:
        run = None
    if run is None:
        return None
    return RunReplay.objects.create(run=run, finished_at=timezone.now(), **_outcome(report))


def _cancel_watch(scenario: Scenario) -> CancelWatch | None:
    """Where to cancel the replay of a turn cancelled while a model call
    streamed: the root step the export marked ``stall_after_chunks``,
    once its text has streamed."""
    for step, turn in enumerate(scenario.turns):
        if turn.stall_after_chunks is not None:
            return CancelWatch(step=step, chars=len(turn.text or ""))
    return None


def replay_user() -> Any:
    """The replay user (:data:`REPLAY_USERNAME`), created on first use:
    inactive, without a usable password."""
    user, created = get_user_model().objects.get_or_create(
        username=REPLAY_USERNAME, defaults={"is_active": False, "email": ""}
    )
    if created:
        user.set_unusable_password()
        user.save(update_fields=["password"])
    return user


def _play_turn(
    thread: Conversation, recorded: Any, plan: ReplayPlan, report: ReplayReport, *, replay_of: str
) -> list[Divergence]:
    """Save the scratch ``thread`` (not saved yet) and submit the turn's
    input in one transaction, then each recorded resume while the replay
    stops for an approval as the recorded turn did; every run executed
    here, each marked as a replay of ``replay_of`` in the transaction that
    creates it (so no reader ever sees it unmarked, and a refused first
    run leaves no empty thread). Returns the divergences found on the way
    (a resume refused)."""

    def execute(create) -> AgentRun:
        with transaction.atomic():
            run = create()
            AgentRun.objects.filter(pk=run.id).update(replay_of=replay_of)
            lease, run = run_acquire_with_row(
                run_id=run.id, owner=REPLAY_OWNER, ttl_seconds=get_config().LEASE_TTL_SECONDS
            )
        report.run_ids.append(str(run.id))
        with replay_plan(run.id, plan):
            run_execute_acquired(lease=lease, run=run, owner=REPLAY_OWNER)
        run.refresh_from_db()
        return run

    user = thread.user

    def first_run() -> AgentRun:
        thread.save(force_insert=True)
        report.thread_id = str(thread.id)
        return ledger.run_submit(user=user, thread_id=thread.id, request_id=uuid.uuid4().hex, text=recorded.input)[0]

    run = execute(first_run)
    for number, resume in enumerate(recorded.resumes, start=2):
        if run.status != AgentRun.Status.INTERRUPTED:
            break  # the comparison reports the runs and the status
        decisions = [dict(d) for d in resume.decisions]
        try:
            run = execute(
                lambda run=run, decisions=decisions: ledger.run_resume(
                    user=user, run_id=run.id, request_id=uuid.uuid4().hex, decisions=decisions
                )[0]
            )
        except ApplicationError as exc:
            return [Divergence(f"run {number}", "resume refused", "the recorded decisions accepted", str(exc))]
    if recorded.status == AgentRun.Status.CANCELLED and run.status == AgentRun.Status.INTERRUPTED:
        # The recorded turn was cancelled while it waited for a human.
        ledger.run_request_cancel(user=user, run_id=run.id)
    return []


# -- the comparison -----------------------------------------------------------

_TIMING = {"chunk_delay_ms", "chunk_chars", "usage_mode"}


def compare(expected: Scenario, got: Scenario, report: ReplayReport | None = None) -> list[Divergence]:
    """The differences between a recorded turn (``expected``) and its
    replay (``got``, exported the same way), in the order they happened:
    for each model call, its request, then what it answered (tool calls,
    text, failure, usage), then the results of the tool calls it declared;
    then each subagent's calls; then the end (runs, status, error type).
    ``report`` (optional) gets the counts compared."""
    found: list[Divergence] = []
    want, have = expected.recorded, got.recorded
    assert want is not None and have is not None
    found += _compare_steps("step", expected.turns, got.turns, want.requests, have.requests, want, have)
    subagent_steps = 0
    for subagent in sorted(set(expected.subagents) | set(got.subagents)):
        turns_a, turns_b = expected.subagents.get(subagent, ()), got.subagents.get(subagent, ())
        subagent_steps += len(turns_a)
        found += _compare_steps(
            f"subagent {subagent} step",
            turns_a,
            turns_b,
            want.subagent_requests.get(subagent, ()),
            have.subagent_requests.get(subagent, ()),
            want,
            have,
        )
    if len(want.run_ids) != len(have.run_ids):
        found.append(Divergence("end", "runs in the turn", len(want.run_ids), len(have.run_ids)))
    if want.status != have.status:
        found.append(Divergence("end", "status", want.status, have.status))
    elif want.error_type != have.error_type:
        found.append(Divergence("end", "error type", want.error_type, have.error_type))
    if report is not None:
        report.steps = len(expected.turns) + subagent_steps
        report.tool_results = len(want.tool_results)
    return found


def _compare_steps(label, turns_a, turns_b, requests_a, requests_b, want, have) -> list[Divergence]:
    found: list[Divergence] = []
    for index in range(max(len(turns_a), len(turns_b))):
        where = f"{label} {index + 1}"
        if index >= len(turns_b):
            found.append(Divergence(where, "model call", _summary(turns_a[index]), "no model call"))
            break
        if index >= len(turns_a):
            found.append(Divergence(where, "model call", "no model call", _summary(turns_b[index])))
            break
        for request in _request_differences(_at(requests_a, index), _at(requests_b, index)):
            found.append(Divergence(where, *request))
        a, b = turns_a[index], turns_b[index]
        for what, value_a, value_b in (
            ("tool calls", _calls(a), _calls(b)),
            ("text", a.text, b.text),
            ("failure", _failure(a), _failure(b)),
            ("usage", _dump(a.usage), _dump(b.usage)),
        ):
            if value_a != value_b:
                found.append(Divergence(where, what, value_a, value_b))
        for call in a.tool_calls:
            facts_a, facts_b = _result(want.tool_results.get(call.id)), _result(have.tool_results.get(call.id))
            if facts_a != facts_b:
                found.append(Divergence(f"{where}, tool call {call.id} ({call.name})", "result", facts_a, facts_b))
    return found


def _request_differences(a: dict | None, b: dict | None) -> list[tuple[str, Any, Any]]:
    """Each part that differs between two request fingerprints
    (``metadata.request``): the system prompt, the tools offered, a tool's
    definition (named when the fingerprints name them), the conversation;
    none when they agree or either is unknown (a row recorded before
    fingerprints). Values are the fingerprints' hashes, shortened: the
    audit keeps no copy of the prompt."""
    if not a or not b or a.get("digest") == b.get("digest"):
        return []
    found: list[tuple[str, Any, Any]] = []
    if a.get("system") != b.get("system"):
        found.append(("request: the system prompt differs", _short(a.get("system")), _short(b.get("system"))))
    if a.get("tool_names") != b.get("tool_names"):
        found.append(("request: the tools offered differ", a.get("tool_names"), b.get("tool_names")))
    elif a.get("tools") != b.get("tools"):
        digests_a, digests_b = a.get("tool_digests") or {}, b.get("tool_digests") or {}
        changed = sorted(name for name in digests_a if digests_a.get(name) != digests_b.get(name))
        what = (
            f"request: the definition of {', '.join(changed)} differs"
            if changed
            else "request: a tool's definition differs"
        )
        found.append((what, _short(a.get("tools")), _short(b.get("tools"))))
    if a.get("messages") != b.get("messages"):
        found.append(
            (
                "request: the conversation sent differs",
                f"{a.get('message_count')} messages ({_short(a.get('messages'))})",
                f"{b.get('message_count')} messages ({_short(b.get('messages'))})",
            )
        )
    return found


def _at(items, index):
    return items[index] if index < len(items) else None


def _short(digest: Any) -> str:
    return f"sha256:{str(digest)[:12]}" if digest else "none"


def _calls(turn: Turn) -> list[dict[str, Any]]:
    return [{"name": c.name, "arguments": c.arguments} for c in turn.tool_calls]


def _failure(turn: Turn) -> dict[str, Any]:
    facts = turn.model_dump(exclude={"text", "tool_calls", "usage", *_TIMING}, exclude_defaults=True, exclude_none=True)
    return facts


def _result(result: Any) -> Any:
    """A recorded tool result as compared: the run id in a workspace path
    it names (``outbox/<run id>/…``) is the replaying run's, not a change."""
    facts = _dump(result)
    if facts and isinstance(facts.get("content"), str):
        facts["content"] = mask_run_paths(facts["content"])
    return facts


def _dump(value: Any) -> Any:
    return value.model_dump(exclude_defaults=True) if value is not None else None


def _summary(turn: Turn) -> str:
    if turn.tool_calls:
        return "tool calls " + ", ".join(
            f"{c.name}({json.dumps(c.arguments, ensure_ascii=False)})" for c in turn.tool_calls
        )
    return f"text {turn.text!r}"


def _show(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 300 else text[:300] + f"… ({len(text)} characters)"
