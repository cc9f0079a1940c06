"""An audited turn replayed as a regression test (R-REPLAY-2): every
bundled scenario's run, exported and replayed on unchanged code, is
identical; a planted change to the agent is reported at the step where
its request changed; the command's exit status and JUnit report."""

from __future__ import annotations

import uuid
from pathlib import Path
from xml.etree import ElementTree

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.urls import reverse
from langchain_core.tools import tool

from audit import ledger
from audit.agents import assistant
from audit.agents import tools as tools_module
from audit.catalogue import BUNDLED_SCENARIO_DIR as BUNDLED_DIR
from audit.execution import shutdown
from audit.execution.rerun import (
    REPLAY_USERNAME,
    ReplayDiverged,
    ReplaySourceError,
    assert_replays_identical,
    load_source,
    replay,
    replay_request,
    replay_requested_run,
    scenario_files,
)
from audit.execution.runner import run_execute
from audit.models import AgentRun, RunReplay
from conversations.models import Conversation, Message
from core.config import get_config
from tests.audit.test_handover import _streamed
from tests.audit.test_scenario_export import BUNDLED, NEEDS_APPROVAL, execute
from tests.audit.test_scenario_export import fast_retries as fast_retries  # noqa: F401 (a fixture)
from tests.audit.test_scenario_export import undelayed_server as undelayed_server  # noqa: F401 (a fixture)
from tests.conftest import make_run, run_in_a_thread

pytestmark = pytest.mark.django_db(transaction=True)


def approved(run: AgentRun) -> AgentRun:
    """Resume an interrupted run with approvals until it ends."""
    while run.status == AgentRun.Status.INTERRUPTED:
        pending = len(run.pending_approval["action_requests"]) if getattr(run, "pending_approval", None) else 1
        resume, _ = ledger.run_resume(
            user=run.user,
            run_id=run.id,
            request_id=uuid.uuid4().hex,
            decisions=[{"type": "approve"}] * pending,
        )
        run_execute(run_id=resume.id, owner="in-process")
        resume.refresh_from_db()
        run = resume
    return run


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_every_bundled_scenario_replays_identical_R_REPLAY_2(name, user, undelayed_server, fast_retries, monkeypatch):
    monkeypatch.setattr(get_config(), "REPLAY_MODEL_URL", undelayed_server)
    run = execute(user, name, "Mail the report" if name in NEEDS_APPROVAL else "hello")
    run = approved(run)

    report = replay(load_source(str(run.id)), source=str(run.id))
    assert report.identical, report.text()
    replayed = AgentRun.objects.get(pk=report.run_ids[-1])
    assert replayed.user.username == REPLAY_USERNAME and replayed.thread_id != run.thread_id
    assert (replayed.status, replayed.error_type) == (run.status, run.error_type)
    # No tool executed: every tool row of the replay is a recorded answer,
    # but a subagent's task, which runs the subagent whose calls replay.
    tools = Message.objects.audit().filter(run_id__in=report.run_ids, role=Message.Role.TOOL)
    assert all((row.metadata or {}).get("source") == "replay_recorded" for row in tools if row.tool_name != "task")


def test_a_later_turn_replays_from_its_history_R_REPLAY_2(user, replay_models):
    first = execute(user, "plain_answer", "hello")
    second = make_run(first.thread, text="and again?")
    run_execute(run_id=second.id, owner="in-process")

    scenario = load_source(str(second.id))
    assert [m["type"] for m in scenario.recorded.history] == ["human", "ai"]
    report = replay(scenario)
    assert report.identical, report.text()
    # The request of the replay held the history: it fingerprints as the
    # recorded one, two messages longer than a first turn's.
    replayed = Message.objects.audit().get(run_id=report.run_ids[0], role=Message.Role.ASSISTANT)
    assert replayed.metadata["request"]["message_count"] == 3


def test_a_changed_system_prompt_is_reported_at_the_first_step_R_REPLAY_2(user, replay_models, monkeypatch):
    run = execute(user, "two_tools_then_answer")
    monkeypatch.setattr(assistant, "SYSTEM_PROMPT", assistant.SYSTEM_PROMPT + " Answer in French.")

    report = replay(load_source(str(run.id)))
    assert not report.identical
    first = report.divergences[0]
    assert (first.where, first.what) == ("step 1", "request: the system prompt differs"), report.text()
    # The model answered as recorded: nothing else differs.
    assert {d.what for d in report.divergences} == {"request: the system prompt differs"}
    assert "DIVERGED at step 1" in report.text()


def test_a_changed_tool_argument_is_reported_at_the_first_step_R_REPLAY_2(user, replay_models, monkeypatch):
    run = execute(user, "tool_then_answer")

    @tool("get_weather")
    def get_weather_in_units(city: str, units: str = "metric") -> str:
        """Current weather for a city, in metric or imperial units."""
        return "{}"

    tools = [get_weather_in_units if t.name == "get_weather" else t for t in assistant.ASSISTANT_TOOLS]
    monkeypatch.setattr(assistant, "ASSISTANT_TOOLS", tools)
    report = replay(load_source(str(run.id)))
    first = report.divergences[0]
    assert (first.where, first.what) == ("step 1", "request: the definition of get_weather differs"), report.text()


def test_live_tools_report_a_changed_result_then_the_request_it_changed_R_REPLAY_2(user, replay_models, monkeypatch):
    run = execute(user, "tool_then_answer")
    assert load_source(str(run.id)).recorded.tool_results["call_weather_paris"].content.startswith("{")

    same = replay(load_source(str(run.id)), tools="live")
    assert same.identical, same.text()
    assert (
        Message.objects.audit()
        .filter(run_id=same.run_ids[0], role=Message.Role.TOOL, metadata__source="replay_recorded")
        .count()
        == 0
    ), "live tools ran for real"

    monkeypatch.setitem(tools_module._WEATHER, "paris", {"temp_c": 31, "sky": "clear"})
    report = replay(load_source(str(run.id)), tools="live")
    wheres = [(d.where, d.what) for d in report.divergences]
    assert wheres[:2] == [
        ("step 1, tool call call_weather_paris (get_weather)", "result"),
        ("step 2", "request: the conversation sent differs"),
    ], report.text()
    # The replay never executes a tool with recorded results.
    recorded = replay(load_source(str(run.id)))
    assert recorded.identical, recorded.text()


def test_the_command_exits_0_identical_1_diverged_2_unreplayable_and_writes_junit_R_REPLAY_2(
    user, replay_models, monkeypatch, tmp_path, capsys
):
    run = execute(user, "tool_then_answer")
    junit = tmp_path / "replay.xml"
    call_command("replay_run", str(run.id), "--junit", str(junit))
    assert "IDENTICAL" in capsys.readouterr().out
    suite = ElementTree.parse(junit).getroot()
    assert (suite.get("tests"), suite.get("failures")) == ("1", "0")

    # From a file written by export_scenario, identical too.
    path = tmp_path / "incident.json"
    call_command("export_scenario", str(run.id), "-o", str(path))
    call_command("replay_run", str(path))
    assert "IDENTICAL" in capsys.readouterr().out

    # Replays from the command show on the recorded run's admin page too.
    assert RunReplay.objects.filter(run=run, requested_by=None, status="identical").count() == 2

    monkeypatch.setattr(assistant, "SYSTEM_PROMPT", "You are terse.")
    with pytest.raises(CommandError) as diverged:
        call_command("replay_run", str(path), "--junit", str(junit))
    assert diverged.value.returncode == 1
    assert "diverged at step 1" in str(diverged.value)
    assert "DIVERGED at step 1" in capsys.readouterr().out
    failure = ElementTree.parse(junit).getroot().find("testcase/failure")
    assert failure is not None and "system prompt" in failure.get("message")

    for bad in (str(uuid.uuid4()), str(tmp_path / "missing.json"), str(BUNDLED_DIR / "plain_answer.json")):
        with pytest.raises(CommandError) as refused:
            call_command("replay_run", bad)
        assert refused.value.returncode == 2, bad
    with pytest.raises(CommandError) as unknown:
        call_command("replay_run", str(run.id), "--agent", "nobody")
    assert unknown.value.returncode == 2


def _cancelled(user, model: str, until) -> AgentRun:
    run, worker, result = run_in_a_thread(user, "worker-a", model=model, until=until)
    ledger.run_request_cancel(user=user, run_id=run.id)
    worker.join(60)
    assert not worker.is_alive(), "the run did not stop"
    run.refresh_from_db()
    assert run.status == AgentRun.Status.CANCELLED
    return run


def _rows(run_id, **filters):
    return Message.objects.audit().filter(run_id=run_id, **filters)


def test_a_run_cancelled_while_the_model_streamed_replays_to_the_same_cut_R_REPLAY_2(user, replay_models):
    run = _cancelled(user, "replay:slow_answer", until=_streamed)
    cut = _rows(run.id, role=Message.Role.ASSISTANT).get()
    assert cut.execution_status == "interrupted" and cut.content

    scenario = load_source(str(run.id))
    assert scenario.turns[0].stall_after_chunks is not None and scenario.turns[0].text == cut.content
    report = replay(scenario)
    assert report.identical, report.text()
    replayed = _rows(report.run_ids[0], role=Message.Role.ASSISTANT).get()
    assert (replayed.execution_status, replayed.content) == ("interrupted", cut.content)
    assert AgentRun.objects.get(pk=report.run_ids[0]).status == AgentRun.Status.CANCELLED


def test_a_run_cancelled_while_a_tool_ran_replays_to_the_same_cut_R_REPLAY_2(user, replay_models):
    run = _cancelled(user, "replay:slow_lookup", until=lambda r: _rows(r.id, role="tool").exists())
    scenario = load_source(str(run.id))
    assert scenario.recorded.tool_results["call_lookup_slow"].status == "interrupted"

    report = replay(scenario)
    assert report.identical, report.text()
    (tool_row,) = _rows(report.run_ids[0], role=Message.Role.TOOL)
    assert tool_row.execution_status == "interrupted"
    assert AgentRun.objects.get(pk=report.run_ids[0]).status == AgentRun.Status.CANCELLED


def test_a_run_cancelled_while_it_waited_for_an_approval_replays_to_the_same_end_R_REPLAY_2(user, replay_models):
    run = execute(user, "approval_send_email", "Mail the report")
    assert run.status == AgentRun.Status.INTERRUPTED
    ledger.run_request_cancel(user=user, run_id=run.id)

    report = replay(load_source(str(run.id)))
    assert report.identical, report.text()
    assert AgentRun.objects.get(pk=report.run_ids[0]).status == AgentRun.Status.CANCELLED


RECORDED_TURNS = Path(__file__).resolve().parents[1] / "fixtures" / "replays"


@pytest.mark.parametrize("scenario", scenario_files(RECORDED_TURNS), ids=lambda path: path.stem)
def test_the_recorded_turns_of_the_bundled_agent_still_replay_identical_R_REPLAY_2(scenario):
    # The pytest helper as the README shows it: a changed prompt, tool or
    # agent that changes what these turns send or do fails here.
    report = assert_replays_identical(scenario)
    assert report.steps >= 2


def test_the_pytest_helper_fails_with_the_report_and_refuses_an_empty_folder_R_REPLAY_2(monkeypatch, tmp_path):
    monkeypatch.setattr(assistant, "SYSTEM_PROMPT", "You are terse.")
    with pytest.raises(AssertionError) as diverged:
        assert_replays_identical(RECORDED_TURNS / "weather_in_paris.json")
    assert isinstance(diverged.value, ReplayDiverged)
    assert "DIVERGED at step 1" in str(diverged.value) and not diverged.value.report.identical
    with pytest.raises(NotADirectoryError):
        scenario_files(tmp_path / "missing")


def test_the_admin_run_page_replays_the_turn_and_shows_the_report_R_REPLAY_2(
    client, staff_user, user, replay_models, monkeypatch
):
    run = execute(user, "tool_then_answer")
    page = reverse("admin:audit_agentrun_change", args=[run.pk])
    client.force_login(staff_user)
    assert b"Replay</button>" in client.get(page).content
    assert client.get(reverse("admin:audit_agentrun_replay", args=[run.pk])).status_code == 405

    response = client.post(reverse("admin:audit_agentrun_replay", args=[run.pk]))
    assert response.status_code == 302 and response["Location"].startswith(page)
    (asked,) = RunReplay.objects.filter(run=run)
    assert (asked.status, asked.requested_by_id) == (RunReplay.Status.PENDING, staff_user.pk)
    # What the worker's task does with it (a second delivery does nothing).
    assert replay_requested_run(asked.id) == RunReplay.Status.IDENTICAL
    assert replay_requested_run(asked.id) == RunReplay.Status.IDENTICAL
    asked.refresh_from_db()
    assert asked.finished_at is not None and "IDENTICAL" in asked.report and len(asked.replay_run_ids) == 1
    html = client.get(page).content.decode()
    assert "identical" in html and "IDENTICAL" in html and asked.replay_run_ids[0][:8] in html

    # A changed prompt: the next replay reports where it diverged.
    monkeypatch.setattr(assistant, "SYSTEM_PROMPT", "You are terse.")
    client.post(reverse("admin:audit_agentrun_replay", args=[run.pk]))
    newest = RunReplay.objects.filter(run=run).first()
    assert replay_requested_run(newest.id) == RunReplay.Status.DIVERGED
    newest.refresh_from_db()
    assert newest.first_divergence == "step 1: request: the system prompt differs"
    assert "step 1: request: the system prompt differs" in client.get(page).content.decode()


def test_an_admin_replay_that_cannot_run_says_why_and_others_cannot_ask_R_REPLAY_2(
    client, user, staff_user, django_user_model
):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    never_started = make_run(thread)
    ledger.run_request_cancel(user=user, run_id=never_started.id)
    asked = replay_request(run_id=never_started.id, user=staff_user)
    assert replay_requested_run(asked.id) == RunReplay.Status.FAILED
    asked.refresh_from_db()
    assert "no model call" in asked.first_divergence and asked.finished_at is not None

    client.force_login(user)  # not staff
    assert client.post(reverse("admin:audit_agentrun_replay", args=[never_started.pk])).status_code == 302
    plain_staff = django_user_model.objects.create_user(username="plain-staff", password="pw-12345678", is_staff=True)
    client.force_login(plain_staff)  # staff without the permission to view runs
    assert client.post(reverse("admin:audit_agentrun_replay", args=[never_started.pk])).status_code == 403
    assert RunReplay.objects.filter(run=never_started).count() == 1


@pytest.mark.parametrize(
    "scenario, until",
    [
        ("replay:slow_answer", _streamed),
        (
            "replay:slow_lookup_then_slow_answer",
            lambda run: Message.objects.audit().filter(run=run, role="tool", execution_status="completed").exists(),
        ),
    ],
    ids=["cut_while_streaming", "after_a_tool_completed"],
)
def test_a_turn_continued_by_another_worker_replays_identical_R_REPLAY_2(scenario, until, user, replay_models):
    # The recorded run was handed over by a stopping worker and continued
    # by another (attempt 2, R-RUN-15): the replay, in one attempt, takes
    # the path the turn finally took.
    run, worker, result = run_in_a_thread(user, "worker-a", model=scenario, until=until)
    shutdown.request_handover()
    try:
        worker.join(60)
        assert result["status"] == "handed_over"
    finally:
        shutdown.clear_handover()
    assert run_execute(run_id=run.id, owner="worker-b") == "completed"
    run.refresh_from_db()
    assert run.attempt == 2

    report = replay(load_source(str(run.id)))
    assert report.identical, report.text()
    assert AgentRun.objects.get(pk=report.run_ids[0]).attempt == 1


def test_a_run_id_replays_its_whole_turn_and_live_tools_ignore_the_run_in_a_path_R_REPLAY_2(
    user, replay_models, monkeypatch, tmp_path
):
    monkeypatch.setattr(get_config(), "WORKSPACE_ROOT", tmp_path / "workspaces")
    first = execute(user, "approval_send_email", "Mail the report")
    last = approved(first)
    # The first run's id stands for the whole turn, its resume included.
    scenario = load_source(str(first.id))
    assert list(scenario.recorded.run_ids) == [str(first.id), str(last.id)] and scenario.recorded.status == "completed"
    # Run live, send_email writes under the replaying run's outbox folder:
    # the same result, not a divergence.
    assert "outbox/" in scenario.recorded.tool_results["call_email_1"].content
    report = replay(scenario, tools="live")
    assert report.identical, report.text()


def test_every_part_of_a_changed_request_is_reported_and_unreadable_sources_say_why_R_REPLAY_2(
    user, replay_models, monkeypatch, tmp_path
):
    run = execute(user, "tool_then_answer")
    monkeypatch.setattr(assistant, "SYSTEM_PROMPT", "You are terse.")
    monkeypatch.setattr(assistant, "ASSISTANT_TOOLS", [t for t in assistant.ASSISTANT_TOOLS if t.name != "calculator"])
    report = replay(load_source(str(run.id)))
    step_one = [d.what for d in report.divergences if d.where == "step 1"]
    assert step_one == ["request: the system prompt differs", "request: the tools offered differ"], report.text()

    with pytest.raises(ReplaySourceError, match="12345: neither a run id nor a scenario file"):
        load_source("12345")
    missing = tmp_path / "nope.json"
    with pytest.raises(ReplaySourceError, match=f"{missing}: neither"):
        load_source(str(missing))
    broken = tmp_path / "broken.json"
    broken.write_text("{", encoding="utf-8")
    with pytest.raises(ReplaySourceError, match=f"{broken}: not valid JSON"):
        load_source(str(broken))
