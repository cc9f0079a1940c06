"""The chat page in a real browser (R-UI-1, R-SEC-1): a user who is not
staff signs in, creates a thread, sends a message, watches the answer
stream in with its tool call, and finds both messages in the history;
a long answer is cancelled from the page; an email the assistant wants to
send is approved, rejected or edited from the page; final answers are
liked and disliked, and show their rating again after a reload; each turn
shows its cost; a long thread's older messages and a long list's older
threads are shown on demand. Real processes: uvicorn, a Celery worker and the replay
model server (tests/e2e/stack.py), Chromium through Playwright. No console error and no Content Security Policy
violation."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from decimal import Decimal

import pytest
import redis
from django.conf import settings
from django.db import connection

from audit.models import AgentRun, pending_action_requests
from audit.replay.scenarios import load_scenarios
from conversations.models import Conversation, MessageFeedback
from core.redis_client import stream_key
from costs.selectors import run_cost
from tests.e2e.stack import database_url_of, free_port, start_stack, start_web
from tests.read.builders import RunDriver
from tests.waiting import WAIT_SECONDS

from .conftest import SCREENSHOTS, _backends_of, _wait_for_backends_to_leave
from .test_admin_browser import _CSP_WATCH

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "pw-chat-1234"
TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def chat_stack(django_db_setup, django_db_blocker):
    """Replay server, web server and one worker on the test database for
    this module's tests; stopped, and its connections gone, after them."""
    s = connection.settings_dict
    with django_db_blocker.unblock():
        own_backends = _backends_of(s["NAME"])
    stack = start_stack(database_url=database_url_of(s), redis_url=settings.CONFIG.REDIS_URL)
    try:
        yield stack
    finally:
        stack.stop()
        with django_db_blocker.unblock():
            _wait_for_backends_to_leave(s["NAME"], keep=own_backends)


@pytest.fixture
def chat_user(django_user_model):
    """A user who is not staff: the chat is for every user."""
    return django_user_model.objects.create_user(username="chat-user", password=PASSWORD)


class Watch:
    """A page's console errors, uncaught exceptions and CSP violations;
    error responses too, but those a test provokes on purpose
    (:meth:`allow`)."""

    def __init__(self, page):
        self.page = page
        self.errors: list[str] = []
        self.allowed: list[tuple[int, str]] = []
        self.lost_connections: list[str] = []
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        page.on("console", self._console)
        page.on("response", lambda r: r.status >= 400 and not self._allowed(r.status, r.url) and self._error(r))

    def allow(self, status: int, url_part: str) -> None:
        """An error answer the test expects (a 409 the page handles), and
        the console line Chromium logs for every failed request."""
        self.allowed.append((status, url_part))

    def allow_lost_connections(self, url_part: str) -> None:
        """The console lines Chromium logs for requests whose connection
        broke or was refused (a web server the test stops): expected."""
        self.lost_connections.append(url_part)

    def _allowed(self, status: int, url: str) -> bool:
        return any(status == s and part in url for s, part in self.allowed)

    def _error(self, response) -> None:
        self.errors.append(f"{response.status}: {response.url}")

    def _console(self, message) -> None:
        if message.type != "error":
            return
        url = message.location.get("url") or ""
        if any(f"status of {s} " in message.text and part in url for s, part in self.allowed):
            return
        lost = "Failed to load resource: net::ERR_" in message.text
        if lost and any(part in url for part in self.lost_connections):
            return
        self.errors.append(f"console: {message.text} ({url})")

    def check(self) -> None:
        violations = self.page.evaluate("window.__cspViolations")
        assert violations == [], violations
        assert self.errors == [], self.errors


def _open_chat(browser, base_url: str, viewport: dict, user):
    context = browser.new_context(viewport=viewport, base_url=base_url)
    context.add_init_script(_CSP_WATCH)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    watch = Watch(page)
    # An anonymous visitor is sent to the sign-in, and back after it.
    page.goto("/chat/")
    page.wait_for_url("**/chat/login/?next=/chat/")
    page.fill("#id_username", user.username)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/chat/")
    return context, page, watch


def _new_thread(page, model: str) -> None:
    page.select_option("#yc-model", model)
    page.click("#yc-new-button")
    page.wait_for_selector("#yc-thread-list .yc-thread[aria-current='true']")
    page.wait_for_selector("#yc-input:enabled")


def _send(page, text: str) -> None:
    page.fill("#yc-input", text)
    page.click("#yc-send-button")


def _wait_for_status(page, status: str) -> None:
    page.wait_for_function(f"() => document.getElementById('yc-app').dataset.runStatus === {status!r}")


def _kinds(page) -> list[str]:
    messages = page.locator("#yc-messages > li")
    return [messages.nth(i).get_attribute("data-kind") for i in range(messages.count())]


def _turn_usd(turn_id: str) -> Decimal:
    """The cost of a turn as the server sums it: its runs' costs."""
    costs = [run_cost(run.id)["total_usd"] for run in AgentRun.objects.filter(turn_id=turn_id)]
    assert costs and all(c is not None for c in costs), costs
    return sum(costs, Decimal(0))


def _assert_turn_cost(item, runs: int) -> None:
    """The cost line under a turn's last item: its runs' summed cost."""
    cost = item.locator(".yc-cost")
    assert cost.inner_text().startswith("Turn cost $"), cost.inner_text()
    assert "tokens (" in cost.inner_text()
    assert cost.get_attribute("data-runs") == str(runs)
    shown = Decimal(cost.get_attribute("data-total-usd"))
    assert abs(shown - _turn_usd(item.get_attribute("data-turn-id"))) < Decimal("0.000001"), shown


def _close_orm_connection() -> None:
    """The ORM reads made while Playwright's sync API runs (greenlets, each
    with its own context) open their own Django connection: close it, or
    it outlives the test and keeps the test database from being dropped."""
    connection.close()


#: What the replay scenario's model asks to send, and answers after.
EMAIL = load_scenarios()["approval_send_email"]


def _ask_for_the_email(page):
    """A thread on the approval scenario, the run interrupted for
    ``send_email``: its approval card."""
    _new_thread(page, "replay:approval_send_email")
    _send(page, "Mail Bob")
    _wait_for_status(page, "interrupted")
    card = page.locator("#yc-approval .yc-action")
    card.wait_for()
    assert card.count() == 1
    return card


@pytest.mark.parametrize(
    "viewport", [{"width": 1280, "height": 900}, {"width": 390, "height": 844}], ids=["1280", "390"]
)
def test_a_user_chats_and_sees_the_answer_stream_in_R_UI_1(chat_stack, chat_user, browser, viewport):
    width = viewport["width"]
    context, page, watch = _open_chat(browser, chat_stack.base_url, viewport, chat_user)
    try:
        assert page.locator("#yc-admin-link").count() == 0  # not staff
        # The select offers the scenarios meant for a person to try, each
        # with its description as a tooltip; not the fault scenarios.
        offered = page.locator("#yc-model option").all_inner_texts()
        assert "replay:tool_then_answer" in offered and "replay:model_unreachable" not in offered
        assert page.locator("#yc-model option[value='replay:tool_then_answer']").get_attribute("title") == (
            load_scenarios()["tool_then_answer"].description
        )
        _new_thread(page, "replay:tool_then_answer")
        _send(page, "What is the weather in Paris today?")

        # The user's message shows at once; the run streams: text deltas and
        # the tool call as it runs.
        page.wait_for_selector("#yc-messages li[data-kind='user']")
        page.wait_for_function("() => Number(document.getElementById('yc-app').dataset.toolEvents) > 0")
        page.screenshot(path=SCREENSHOTS / f"chat-live-{width}.png")  # the run may have ended already
        page.wait_for_function("() => document.getElementById('yc-app').dataset.runStatus === 'completed'")
        assert int(page.locator("#yc-app").get_attribute("data-deltas")) >= 20  # an answer of many chunks
        assert page.locator("#yc-live").is_hidden()

        # The history now holds the question, the tool call with its result
        # and the answer.
        messages = page.locator("#yc-messages > li")
        assert [messages.nth(i).get_attribute("data-kind") for i in range(messages.count())] == [
            "user",
            "tool_carrier",
            "answer",
        ]
        assert "What is the weather in Paris today?" in messages.nth(0).inner_text()
        tool = messages.nth(1).locator(".yc-tool")
        assert tool.locator(".yc-tool-name").inner_text() == "get_weather"
        assert tool.locator(".yc-tool-status").inner_text() == "completed"
        assert "18°C and sunny in Paris" in messages.nth(2).inner_text()
        # Only the final answer takes feedback; the turn's cost shows under it.
        assert messages.nth(1).locator(".yc-feedback").count() == 0
        assert messages.nth(2).locator(".yc-feedback button").all_inner_texts() == ["Like", "Dislike"]
        assert page.locator("#yc-messages .yc-cost").count() == 1
        _assert_turn_cost(messages.nth(2), runs=1)
        # The thread is named after the first words of its first message.
        page.wait_for_function(
            "() => document.querySelector('#yc-thread-list .yc-thread').textContent.startsWith('What is the weather')"
        )
        assert page.locator("#yc-input").is_enabled()
        # Readable at this width: the page never scrolls sideways.
        assert page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")
        page.screenshot(path=SCREENSHOTS / f"chat-{width}.png", full_page=True)

        # A reload shows the same thread (the address names it) and history.
        page.reload()
        page.wait_for_selector("#yc-messages > li[data-kind='answer']")
        assert page.locator("#yc-messages > li").count() == 3
        watch.check()
    finally:
        context.close()
        _close_orm_connection()


def test_a_user_cancels_a_long_answer_R_UI_1(chat_stack, chat_user, browser):
    context, page, watch = _open_chat(browser, chat_stack.base_url, {"width": 1280, "height": 900}, chat_user)
    try:
        _new_thread(page, "replay:long_answer")
        _send(page, "Tell me a long story.")
        # The answer streams (one chunk a second) and Cancel is offered.
        page.wait_for_function("() => Number(document.getElementById('yc-app').dataset.deltas) >= 2")
        assert page.locator("#yc-cancel").is_visible()
        streamed = page.locator("#yc-live-text").inner_text()
        assert len(streamed) > 0 and load_scenarios()["long_answer"].turns[0].text.startswith(streamed), streamed
        page.screenshot(path=SCREENSHOTS / "chat-streaming-1280.png")
        # A reload while the run goes on follows it again (the address
        # names the thread; its newest run is still running).
        page.reload()
        page.wait_for_function("() => Number(document.getElementById('yc-app').dataset.deltas) >= 1")
        assert page.locator("#yc-cancel").is_visible()
        assert page.locator("#yc-messages > li[data-kind='user']").count() == 1
        page.click("#yc-cancel")
        page.wait_for_function("() => document.getElementById('yc-app').dataset.runStatus === 'cancelled'")
        assert page.locator("#yc-status").inner_text() == "The run was cancelled."
        assert page.locator("#yc-cancel").is_hidden()
        assert page.locator("#yc-input").is_enabled()
        # The history keeps the question; the cut-off answer is no final answer.
        assert page.locator("#yc-messages > li[data-kind='user']").count() == 1
        assert page.locator("#yc-messages > li[data-kind='answer']").count() == 0
        # Its cost line never says "0 tokens" for a run cut off before the
        # model reported any usage (found by a newcomer, twice): the run's
        # usage counts its one model call as unknown, with zero tokens.
        question = page.locator("#yc-messages > li[data-kind='user']")
        page.wait_for_selector("#yc-messages > li[data-kind='user'] .yc-cost")
        run = AgentRun.objects.get(turn_id=question.get_attribute("data-turn-id"))
        assert run.usage is not None and run.usage["unknown_calls"] == 1, run.usage
        assert run.usage["input_tokens"] == run.usage["output_tokens"] == 0, run.usage
        cost = question.locator(".yc-cost").inner_text()
        assert cost.endswith(" · tokens unknown") and "0 tokens" not in cost, cost
        page.screenshot(path=SCREENSHOTS / "chat-cancelled-1280.png")
        watch.check()
    finally:
        context.close()
        _close_orm_connection()


@pytest.mark.parametrize(
    "viewport", [{"width": 1280, "height": 900}, {"width": 390, "height": 844}], ids=["1280", "390"]
)
def test_a_user_approves_the_email_the_assistant_wants_to_send_R_UI_1(chat_stack, chat_user, browser, viewport):
    width = viewport["width"]
    context, page, watch = _open_chat(browser, chat_stack.base_url, viewport, chat_user)
    try:
        card = _ask_for_the_email(page)
        # The tool and its arguments, the decisions it allows; the thread
        # is held: no new message, Cancel offered.
        assert card.locator(".yc-tool-name").inner_text() == "send_email"
        assert json.loads(card.locator(".yc-args").inner_text()) == EMAIL.turns[0].tool_calls[0].arguments
        # A sentence, not LangChain's default description with the arguments
        # as a Python repr above the same arguments as JSON (a newcomer's
        # finding); the audit keeps that description as it was.
        assert card.locator(".yc-action-description").inner_text() == "send_email needs your approval."
        assert "Args:" not in card.inner_text() and "Tool execution requires approval" not in card.inner_text()
        run = AgentRun.objects.get(status="interrupted")
        [request] = pending_action_requests(run.interrupts)
        assert request["description"].startswith("Tool execution requires approval")
        assert [t.strip() for t in card.locator(".yc-choice").all_inner_texts()] == ["Approve", "Edit", "Reject"]
        assert page.locator("#yc-status").inner_text() == "The run waits for your approval."
        assert page.locator("#yc-input").is_disabled() and page.locator("#yc-cancel").is_visible()
        assert page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")
        page.screenshot(path=SCREENSHOTS / f"chat-approval-{width}.png", full_page=True)

        # A reload shows the pending approval again (the thread's newest run).
        page.reload()
        page.locator("#yc-approval .yc-action").wait_for()
        _wait_for_status(page, "interrupted")
        # Sending without a decision sends nothing.
        page.click("#yc-approval-submit")
        assert page.locator(".yc-approval-error").inner_text() == "Choose a decision for send_email."
        assert not AgentRun.objects.filter(resumed_from__isnull=False).exists()

        page.check("#yc-approval input[value='approve']")
        page.click("#yc-approval-submit")
        _wait_for_status(page, "completed")
        assert page.locator("#yc-approval").is_hidden()
        assert _kinds(page) == ["user", "tool_carrier", "answer"]
        messages = page.locator("#yc-messages > li")
        tool = messages.nth(1).locator(".yc-tool")
        assert tool.locator(".yc-tool-name").inner_text() == "send_email"
        assert tool.locator(".yc-tool-status").inner_text() == "completed"
        assert messages.nth(2).locator(".yc-text").inner_text() == EMAIL.turns[1].text
        # The turn's cost: the interrupted run and its resume.
        _assert_turn_cost(messages.nth(2), runs=2)
        resume = AgentRun.objects.get(resumed_from__isnull=False)
        assert resume.status == "completed" and resume.input["decisions"][0]["type"] == "approve"
        assert page.locator("#yc-input").is_enabled()
        page.screenshot(path=SCREENSHOTS / f"chat-approved-{width}.png", full_page=True)

        page.reload()
        page.wait_for_selector("#yc-messages > li[data-kind='answer'] .yc-cost")
        assert page.locator("#yc-approval").is_hidden()
        watch.check()
    finally:
        context.close()
        _close_orm_connection()


def test_a_user_rejects_the_email_with_a_reason_R_UI_1(chat_stack, chat_user, browser):
    context, page, watch = _open_chat(browser, chat_stack.base_url, {"width": 1280, "height": 900}, chat_user)
    try:
        card = _ask_for_the_email(page)
        card.locator("input[value='reject']").check()
        # The reason field opens with Reject; the arguments editor stays shut.
        assert card.locator(".yc-edit-args").is_hidden()
        card.locator(".yc-reject-message").fill("Not now, Bob is on holiday.")
        page.click("#yc-approval-submit")
        _wait_for_status(page, "completed")
        assert _kinds(page) == ["user", "tool_carrier", "answer"]
        messages = page.locator("#yc-messages > li")
        assert messages.nth(1).locator(".yc-tool-status").inner_text() == "rejected"
        assert messages.nth(2).locator(".yc-text").inner_text() == EMAIL.turns[1].text_if_rejected
        resume = AgentRun.objects.get(resumed_from__isnull=False)
        [decision] = resume.input["decisions"]
        assert decision["type"] == "reject" and "Not now, Bob is on holiday." in json.dumps(decision)
        _assert_turn_cost(messages.nth(2), runs=2)
        watch.check()
    finally:
        context.close()
        _close_orm_connection()


def test_a_user_edits_the_email_before_it_is_sent_R_UI_1(chat_stack, chat_user, browser):
    context, page, watch = _open_chat(browser, chat_stack.base_url, {"width": 390, "height": 844}, chat_user)
    try:
        card = _ask_for_the_email(page)
        card.locator("input[value='edit']").check()
        editor = card.locator(".yc-edit-args")
        assert json.loads(editor.input_value()) == EMAIL.turns[0].tool_calls[0].arguments
        # Invalid JSON: an error, and nothing is sent.
        editor.fill('{"to": "bob@example.com",')
        page.click("#yc-approval-submit")
        assert "not valid JSON" in page.locator(".yc-approval-error").inner_text()
        editor.fill('["bob@example.com"]')
        page.click("#yc-approval-submit")
        assert page.locator(".yc-approval-error").inner_text() == "The arguments of send_email must be a JSON object."
        assert not AgentRun.objects.filter(resumed_from__isnull=False).exists()
        page.screenshot(path=SCREENSHOTS / "chat-approval-edit-390.png", full_page=True)

        edited = {**EMAIL.turns[0].tool_calls[0].arguments, "to": "bob@example.com"}
        editor.fill(json.dumps(edited, indent=2))
        page.click("#yc-approval-submit")
        _wait_for_status(page, "completed")
        messages = page.locator("#yc-messages > li")
        tool = messages.nth(1).locator(".yc-tool")
        assert tool.locator(".yc-tool-status").inner_text() == "completed"
        assert tool.locator("pre").text_content().startswith("Email to bob@example.com recorded as ")
        assert messages.nth(2).locator(".yc-text").inner_text() == EMAIL.turns[1].text
        [decision] = AgentRun.objects.get(resumed_from__isnull=False).input["decisions"]
        assert decision["type"] == "edit" and decision["edited_action"]["args"] == edited
        watch.check()
    finally:
        context.close()
        _close_orm_connection()


def test_a_user_rates_answers_and_sees_each_turns_cost_R_UI_1(chat_stack, chat_user, browser):
    context, page, watch = _open_chat(browser, chat_stack.base_url, {"width": 1280, "height": 900}, chat_user)
    try:
        _new_thread(page, "replay:plain_answer")
        for text in ("Hello", "Hello again"):
            _send(page, text)
            page.wait_for_function(
                f"() => document.querySelectorAll('#yc-messages > li[data-kind=answer]').length === "
                f"{1 if text == 'Hello' else 2} && document.getElementById('yc-app').dataset.runStatus === 'completed'"
            )
        answers = page.locator("#yc-messages > li[data-kind='answer']")
        # One cost line per turn, under its answer.
        assert page.locator("#yc-messages .yc-cost").count() == 2
        for i in range(2):
            _assert_turn_cost(answers.nth(i), runs=1)
        assert answers.nth(0).get_attribute("data-turn-id") != answers.nth(1).get_attribute("data-turn-id")

        first = answers.nth(0)
        message_id = int(first.get_attribute("data-message-id"))
        first.get_by_role("button", name="Like", exact=True).click()
        page.wait_for_selector(f"li[data-message-id='{message_id}'] .yc-feedback[data-rating='like']")
        assert first.get_by_role("button", name="Like", exact=True).get_attribute("aria-pressed") == "true"
        assert first.get_by_role("button", name="Dislike", exact=True).get_attribute("aria-pressed") == "false"
        assert MessageFeedback.objects.get(message_id=message_id).rating == "like"
        first.get_by_role("button", name="Dislike", exact=True).click()
        page.wait_for_selector(f"li[data-message-id='{message_id}'] .yc-feedback[data-rating='dislike']")
        assert first.get_by_role("button", name="Like", exact=True).get_attribute("aria-pressed") == "false"
        feedback = MessageFeedback.objects.get(message_id=message_id)
        assert feedback.rating == "dislike" and feedback.user_id == chat_user.pk
        page.screenshot(path=SCREENSHOTS / "chat-feedback-cost-1280.png", full_page=True)

        # After a reload the rating stays (one row, dislike) and shows: the
        # history carries it; the answer still takes feedback, the other
        # answer shows none, and the costs show again.
        page.reload()
        page.wait_for_selector("#yc-messages > li[data-kind='answer'] .yc-cost")
        assert page.locator("#yc-messages .yc-cost").count() == 2
        assert MessageFeedback.objects.filter(message_id=message_id).count() == 1
        assert MessageFeedback.objects.get(message_id=message_id).rating == "dislike"
        first = page.locator(f"li[data-message-id='{message_id}']")
        assert first.locator(".yc-feedback button").count() == 2
        assert first.locator(".yc-feedback").get_attribute("data-rating") == "dislike"
        assert first.get_by_role("button", name="Dislike", exact=True).get_attribute("aria-pressed") == "true"
        assert first.get_by_role("button", name="Like", exact=True).get_attribute("aria-pressed") == "false"
        unrated = page.locator("#yc-messages > li[data-kind='answer']").nth(1)
        assert unrated.locator(".yc-feedback").get_attribute("data-rating") == ""
        assert unrated.locator("button[aria-pressed='true']").count() == 0
        watch.check()
    finally:
        context.close()
        _close_orm_connection()


def _thread_id(page) -> str:
    return page.locator("#yc-thread-list .yc-thread[aria-current='true']").get_attribute("data-thread-id")


def _listed(page) -> list[str]:
    return page.locator("#yc-thread-list .yc-thread").evaluate_all("buttons => buttons.map(b => b.dataset.threadId)")


def _answered(page, text: str) -> None:
    """Send ``text`` on the open thread and wait for its answer."""
    answers = page.locator("#yc-messages > li[data-kind='answer']").count()
    _send(page, text)
    page.wait_for_function(
        f"() => document.querySelectorAll('#yc-messages > li[data-kind=answer]').length === {answers + 1}"
        " && document.getElementById('yc-app').dataset.runStatus === 'completed'"
    )


@pytest.mark.parametrize(
    "viewport", [{"width": 1280, "height": 900}, {"width": 390, "height": 844}], ids=["1280", "390"]
)
def test_a_user_renames_archives_and_unarchives_a_thread_R_UI_1(chat_stack, chat_user, browser, viewport):
    width = viewport["width"]
    context, page, watch = _open_chat(browser, chat_stack.base_url, viewport, chat_user)
    try:
        _new_thread(page, "replay:plain_answer")
        _answered(page, "Hello there")
        thread_id = _thread_id(page)
        page.wait_for_function("() => document.getElementById('yc-thread-title').textContent === 'Hello there'")

        # Rename inline: the field opens with the title, Escape leaves it as it was.
        page.get_by_role("button", name="Rename", exact=True).click()
        field = page.get_by_label("Thread title")
        assert field.evaluate("f => f === document.activeElement") and field.input_value() == "Hello there"
        assert page.locator("#yc-thread-actions").is_hidden()
        field.press("Escape")
        assert page.locator("#yc-rename").is_hidden()
        assert page.locator("#yc-thread-title").inner_text() == "Hello there"
        # A blank title is refused in the page; nothing is sent.
        page.get_by_role("button", name="Rename", exact=True).click()
        field.fill("   ")
        page.click("#yc-rename-save")
        assert page.locator("#yc-rename-error").inner_text() == "The title cannot be blank."
        assert Conversation.objects.get(pk=thread_id).title == "Hello there"
        field.fill("Trip to Paris")
        page.screenshot(path=SCREENSHOTS / f"chat-rename-{width}.png", full_page=True)
        field.press("Enter")
        page.wait_for_function("() => document.getElementById('yc-thread-title').textContent === 'Trip to Paris'")
        assert page.locator("#yc-rename").is_hidden()
        assert page.locator(f".yc-thread[data-thread-id='{thread_id}']").inner_text().startswith("Trip to Paris")
        assert Conversation.objects.get(pk=thread_id).title == "Trip to Paris"
        page.reload()
        page.wait_for_selector("#yc-messages > li[data-kind='answer']")
        assert page.locator("#yc-thread-title").inner_text() == "Trip to Paris"

        # Archive: the thread stays open, marked, and leaves the list.
        page.get_by_role("button", name="Archive", exact=True).click()
        page.wait_for_function("() => !document.getElementById('yc-thread-archived').hidden")
        page.wait_for_function(f"() => !document.querySelector(\".yc-thread[data-thread-id='{thread_id}']\")")
        assert "the list hides it" in page.locator("#yc-status").inner_text()
        assert page.get_by_role("button", name="Unarchive", exact=True).is_visible()
        assert Conversation.objects.get(pk=thread_id).archived
        assert page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")
        page.screenshot(path=SCREENSHOTS / f"chat-archived-{width}.png", full_page=True)
        # After a reload the address still opens it; the list shows it only
        # with "Show archived threads".
        page.reload()
        page.wait_for_selector("#yc-messages > li[data-kind='answer']")
        assert page.locator("#yc-thread-archived").is_visible()
        assert thread_id not in _listed(page)
        page.get_by_label("Show archived threads").check()
        archived = page.locator(f".yc-thread[data-thread-id='{thread_id}']")
        archived.wait_for()
        assert archived.get_attribute("data-archived") == "true" and "archived ·" in archived.inner_text()
        page.get_by_label("Show archived threads").uncheck()
        page.wait_for_function(f"() => !document.querySelector(\".yc-thread[data-thread-id='{thread_id}']\")")

        # Unarchive: back in the list, after a reload too.
        page.get_by_role("button", name="Unarchive", exact=True).click()
        page.wait_for_selector(f".yc-thread[data-thread-id='{thread_id}'][data-archived='false']")
        assert page.locator("#yc-thread-archived").is_hidden()
        assert not Conversation.objects.get(pk=thread_id).archived
        page.reload()
        page.wait_for_selector(f".yc-thread[data-thread-id='{thread_id}'][aria-current='true']")
        assert page.get_by_role("button", name="Archive", exact=True).is_visible()
        assert page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")
        watch.check()
    finally:
        context.close()
        _close_orm_connection()


@pytest.mark.parametrize(
    "viewport", [{"width": 1280, "height": 900}, {"width": 390, "height": 844}], ids=["1280", "390"]
)
def test_a_user_deletes_a_thread_after_confirming_R_UI_1(chat_stack, chat_user, browser, viewport):
    width = viewport["width"]
    context, page, watch = _open_chat(browser, chat_stack.base_url, viewport, chat_user)
    try:
        _new_thread(page, "replay:plain_answer")
        kept = _thread_id(page)
        _new_thread(page, "replay:plain_answer")
        _answered(page, "Forget me")
        thread_id = _thread_id(page)

        # The confirmation; keeping the thread changes nothing.
        page.get_by_role("button", name="Delete", exact=True).click()
        dialog = page.get_by_role("dialog", name="Delete this thread?")
        dialog.wait_for()
        assert "cannot be undone" in dialog.inner_text()
        assert page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")
        page.screenshot(path=SCREENSHOTS / f"chat-delete-{width}.png")
        dialog.get_by_role("button", name="Keep the thread").click()
        assert dialog.is_hidden()
        assert Conversation.objects.get(pk=thread_id).status != "deleted"

        page.get_by_role("button", name="Delete", exact=True).click()
        dialog.get_by_role("button", name="Delete", exact=True).click()
        page.wait_for_function("() => document.getElementById('yc-status').textContent.startsWith('Thread deleted')")
        assert dialog.is_hidden()
        assert _listed(page) == [kept]
        assert page.locator("#yc-thread-title").inner_text() == "Choose a thread or start a new one"
        assert page.locator("#yc-messages > li").count() == 0
        assert page.locator("#yc-thread-actions").is_hidden() and page.locator("#yc-input").is_disabled()
        assert page.evaluate("() => location.hash") == ""
        assert Conversation.objects.get(pk=thread_id).status == "deleted"
        assert page.request.get(f"/api/threads/{thread_id}").status == 404

        page.reload()
        page.wait_for_selector(f".yc-thread[data-thread-id='{kept}']")
        assert _listed(page) == [kept]
        page.get_by_label("Show archived threads").check()
        page.wait_for_function("() => document.querySelectorAll('#yc-thread-list .yc-thread').length === 1")
        watch.check()
    finally:
        context.close()
        _close_orm_connection()


def test_deleting_a_thread_whose_run_goes_on_offers_to_cancel_it_R_UI_1(chat_stack, chat_user, browser):
    context, page, watch = _open_chat(browser, chat_stack.base_url, {"width": 390, "height": 844}, chat_user)
    try:
        _new_thread(page, "replay:long_answer")
        thread_id = _thread_id(page)
        _send(page, "Tell me a long story.")
        page.wait_for_function("() => Number(document.getElementById('yc-app').dataset.deltas) >= 1")

        # The server refuses (409 run_active): the page says so and offers
        # to cancel the run; nothing is deleted yet.
        watch.allow(409, f"/api/threads/{thread_id}")
        page.get_by_role("button", name="Delete", exact=True).click()
        dialog = page.get_by_role("dialog", name="Delete this thread?")
        dialog.get_by_role("button", name="Delete", exact=True).click()
        cancel_and_delete = dialog.get_by_role("button", name="Cancel the run and delete")
        cancel_and_delete.wait_for()
        assert "still going" in dialog.inner_text()
        assert dialog.get_by_role("button", name="Delete", exact=True).is_hidden()
        assert Conversation.objects.get(pk=thread_id).status != "deleted"
        assert AgentRun.objects.get(thread_id=thread_id).status == "running"
        page.screenshot(path=SCREENSHOTS / "chat-delete-running-390.png")

        cancel_and_delete.click()
        page.wait_for_function("() => document.getElementById('yc-status').textContent.startsWith('Thread deleted')")
        assert dialog.is_hidden()
        assert thread_id not in _listed(page)
        assert Conversation.objects.get(pk=thread_id).status == "deleted"
        assert AgentRun.objects.get(thread_id=thread_id).status in {"cancel_requested", "cancelled"}
        page.reload()
        page.wait_for_selector("#yc-thread-title")
        assert thread_id not in _listed(page)
        assert page.request.get(f"/api/threads/{thread_id}").status == 404
        watch.check()
    finally:
        context.close()
        _close_orm_connection()


#: The slow answer the restart test follows: about 105 chunks, one a second.
LONG = load_scenarios()["long_answer"].turns[0]


def _published_deltas(run_id) -> int:
    """The ``model.delta`` events the worker has published for the run."""
    client = redis.Redis.from_url(settings.CONFIG.REDIS_URL)
    try:
        return sum(1 for _id, fields in client.xrange(stream_key(run_id)) if fields[b"type"] == b"model.delta")
    finally:
        client.close()


def _shown_deltas(page) -> int:
    return int(page.locator("#yc-app").get_attribute("data-deltas"))


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"still not {what} after {WAIT_SECONDS}s"
        time.sleep(0.2)


class PrivateWeb:
    """A web server of one test's own (the module's stays up), which the
    test kills (SIGKILL: no draining, connections just break) and starts
    again on the same port; the stack's worker runs the turns."""

    def __init__(self, name: str, env: dict):
        self.name, self.env, self.port = name, env, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = start_web(name, self.port, env)

    def kill(self) -> None:
        self.process.kill()

    def start_again(self) -> None:
        self.process = start_web(self.name, self.port, self.env)

    def stop(self) -> None:
        self.process.stop()


@contextlib.contextmanager
def _a_long_answer_through_a_private_web(name: str, chat_stack, chat_user, browser):
    """A page on a :class:`PrivateWeb` that follows a long answer (about
    105 chunks, one a second) until it shows three chunks: ``(web, page,
    watch, run)``. Closes the page, stops the web server and the ORM's
    connection at the end."""
    web = PrivateWeb(name, chat_stack.env)
    context = None
    try:
        context, page, watch = _open_chat(browser, web.url, {"width": 1280, "height": 900}, chat_user)
        yield web, page, watch, _start_a_long_answer(page, chat_user)
    finally:
        if context is not None:
            context.close()
        web.stop()
        _close_orm_connection()


def _start_a_long_answer(page, chat_user) -> AgentRun:
    _new_thread(page, "replay:long_answer")
    _send(page, "Tell me a long story.")
    page.wait_for_function("() => Number(document.getElementById('yc-app').dataset.deltas) >= 3")
    return AgentRun.objects.get(thread__user=chat_user)


def _runs_on_without_the_web_server(run, shown: int) -> None:
    """The run goes on while no web server is up: three more chunks the
    page must get once it reconnects, with none it holds repeated."""
    _wait(lambda: _published_deltas(run.id) >= shown + 3, "three more chunks published")
    assert AgentRun.objects.get(pk=run.pk).status == "running"


def _wait_until_completed(page) -> None:
    """The bound: the answer's length (one chunk a second) and the usual wait."""
    page.wait_for_function(
        "() => document.getElementById('yc-app').dataset.runStatus === 'completed'",
        timeout=(len(LONG.text) / LONG.chunk_chars * LONG.chunk_delay_ms / 1000 + WAIT_SECONDS) * 1000,
    )


def _shows_the_whole_answer_once(page, run, screenshot: str) -> None:
    """Every chunk once, in order (a stream read again from its start
    without clearing would repeat chunks: the page counts them all), the
    live answer the whole text, no lasting error; the same after a reload,
    from the history."""
    assert _shown_deltas(page) == _published_deltas(run.id)
    assert page.locator("#yc-live-text").text_content() == LONG.text
    assert "yc-error" not in page.locator("#yc-status").get_attribute("class")
    for reloaded in (False, True):
        if reloaded:
            page.reload()
            page.wait_for_selector("#yc-messages > li[data-kind='answer'] .yc-cost")
        assert _kinds(page) == ["user", "answer"]
        assert page.locator("#yc-messages > li[data-kind='answer'] .yc-text").inner_text() == LONG.text
        if not reloaded:
            page.screenshot(path=SCREENSHOTS / screenshot, full_page=True)


def test_the_answer_streams_on_across_a_web_server_restart_R_UI_1(chat_stack, chat_user, browser):
    """The web server the page follows a run through is killed mid-stream
    and started again on the same port: the browser's EventSource
    reconnects with Last-Event-ID, and the page ends with the whole answer
    once, as the history has it."""
    with _a_long_answer_through_a_private_web("chat-web-restart", chat_stack, chat_user, browser) as (
        web,
        page,
        watch,
        run,
    ):
        # The requests the stream makes: the first, then each reconnect.
        streams: list = []
        page.on("request", lambda r: "/events" in r.url and streams.append(r))
        # Chromium logs the broken stream and each refused reconnect.
        watch.allow_lost_connections(f"/api/runs/{run.id}/events")

        web.kill()
        _runs_on_without_the_web_server(run, _shown_deltas(page))
        web.start_again()

        _wait_until_completed(page)
        # The stream was opened again (Playwright does not show the
        # Last-Event-ID it carried) and went on after the last chunk the
        # page held.
        assert len(streams) >= 2, streams
        _shows_the_whole_answer_once(page, run, "chat-after-restart-1280.png")
        watch.check()


def _poll(page, condition, what: str) -> None:
    """:func:`_wait` with Playwright's own pause, so that the page's
    routes are answered meanwhile (the sync API runs their handlers only
    inside its calls)."""
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"still not {what} after {WAIT_SECONDS}s"
        page.wait_for_timeout(200)


def test_the_page_recovers_when_the_browser_gives_up_on_the_stream_R_UI_1(chat_stack, chat_user, browser):
    """A proxy answers 502 while the web server behind it restarts: the
    browser's EventSource gets no stream on reconnecting and gives up
    (readyState CLOSED). The page tries again after a pause, doubling,
    reads the run once the server is back, follows it with a new stream,
    which starts from the run's first event, and rebuilds the live answer
    from it: the whole answer shows once, with no lasting error. The
    proxy is Playwright's routes on the run's URLs."""
    with _a_long_answer_through_a_private_web("chat-web-gateway", chat_stack, chat_user, browser) as (
        web,
        page,
        watch,
        run,
    ):
        events_url = f"/api/runs/{run.id}/events"
        down = True
        refused: list[str] = []  # the paths the proxy answered 502
        passed: list[str] = []

        def gateway(route):
            path = route.request.url.removeprefix(web.url)
            if down:
                refused.append(path)
                route.fulfill(status=502, content_type="text/html", body="<h1>502 Bad Gateway</h1>")
            else:
                passed.append(path)
                route.continue_()

        page.route(f"**{events_url}", gateway)
        page.route(f"**/api/runs/{run.id}", gateway)
        watch.allow(502, f"/api/runs/{run.id}")
        watch.allow_lost_connections(events_url)  # the stream the kill breaks

        web.kill()
        shown = _shown_deltas(page)
        # The reconnect gets the proxy's 502: the browser closes the stream,
        # the page says it reconnects (no error) and reads the run after a
        # pause, again after a longer one.
        _poll(page, lambda: refused.count(f"/api/runs/{run.id}") >= 2, "two reads of the run refused")
        assert refused[0] == events_url, refused
        assert page.locator("#yc-status").inner_text() == "Reconnecting…"
        assert "yc-error" not in page.locator("#yc-status").get_attribute("class")
        assert page.evaluate("() => document.getElementById('yc-live-text').textContent.length") > 0
        _runs_on_without_the_web_server(run, shown)
        web.start_again()
        down = False

        _wait_until_completed(page)
        # One new stream, no second follower; it started from the first
        # event and the live answer was rebuilt from it.
        assert passed.count(events_url) == 1, passed
        page.unroute_all()
        _shows_the_whole_answer_once(page, run, "chat-after-gateway-502-1280.png")
        watch.check()


def _seed_turns(monkeypatch, user, turns: int) -> Conversation:
    """A thread of ``turns`` completed turns, each a question and its answer
    ("Question 1", "Answer 1", ...), written the way a worker writes them
    (tests/read/builders.py); quicker than playing them. Nothing is
    enqueued: the module's worker has no run of it to play."""
    monkeypatch.setattr("audit.ledger.runs.enqueue_run", lambda run_id: None)
    thread = Conversation.objects.create(
        user=user, agent_id="assistant", model="replay:plain_answer", title=f"{turns} turns"
    )
    for i in range(1, turns + 1):
        RunDriver(thread, text=f"Question {i}").model(f"lc_run--{uuid.uuid4().hex}", content=f"Answer {i}").finish()
    return thread


def _texts(page) -> list[str]:
    return page.locator("#yc-messages > li > .yc-text").all_inner_texts()


def _top(locator) -> float:
    return locator.evaluate("element => element.getBoundingClientRect().top")


@pytest.mark.parametrize(
    "viewport", [{"width": 1280, "height": 900}, {"width": 390, "height": 844}], ids=["1280", "390"]
)
def test_a_user_reads_the_older_messages_of_a_long_thread_R_UI_1(web_url, chat_user, browser, viewport, monkeypatch):
    """A newcomer found only the newest page (200 items) of a long thread:
    "Show older messages" prepends the page before it, the messages in view
    staying where they were, until the first."""
    width = viewport["width"]
    # 105 turns, 210 items: the newest page holds turns 6 to 105.
    thread = _seed_turns(monkeypatch, chat_user, 105)
    context, page, watch = _open_chat(browser, web_url, viewport, chat_user)
    try:
        page.click(f".yc-thread[data-thread-id='{thread.id}']")
        page.wait_for_selector("#yc-input:enabled")
        page.wait_for_function("() => document.querySelectorAll('#yc-messages .yc-cost').length === 100")
        texts = _texts(page)
        assert len(texts) == 200 and texts[:2] == ["Question 6", "Answer 6"] and texts[-1] == "Answer 105"
        older = page.get_by_role("button", name="Show older messages")
        assert older.is_visible()

        older.scroll_into_view_if_needed()
        anchor = page.locator("#yc-messages > li").first
        anchor = page.locator(f"#yc-messages > li[data-message-id='{anchor.get_attribute('data-message-id')}']")
        top = _top(anchor)
        older.click()
        page.wait_for_function("() => document.querySelectorAll('#yc-messages > li').length === 210")
        # The message that was first is still where it was, the button
        # hidden (nothing older is left to show) and the cost lines of the
        # older turns, under their answers, added above it: within 2 px (a
        # newcomer saw it move down by 24 px at 1280, 69 px at 390).
        assert older.is_hidden()
        assert abs(_top(anchor) - top) <= 2, (_top(anchor), top)
        page.wait_for_function("() => document.querySelectorAll('#yc-messages .yc-cost').length === 105")
        assert abs(_top(anchor) - top) <= 2, (_top(anchor), top)
        # The older ones are above it, in order.
        texts = _texts(page)
        assert texts[:12] == [f"{kind} {i}" for i in range(1, 7) for kind in ("Question", "Answer")]
        assert texts == [f"{kind} {i}" for i in range(1, 106) for kind in ("Question", "Answer")]
        assert page.locator("#yc-messages > li").first.locator(".yc-cost").count() == 0
        assert page.locator("#yc-messages > li").nth(1).locator(".yc-cost").count() == 1
        assert page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")
        page.evaluate("() => window.scrollTo(0, 0)")
        page.screenshot(path=SCREENSHOTS / f"chat-older-messages-{width}.png")

        # A reload shows the newest page again.
        page.reload()
        page.wait_for_function("() => document.querySelectorAll('#yc-messages > li').length === 200")
        assert older.is_visible()
        watch.check()
    finally:
        context.close()
        _close_orm_connection()


@pytest.mark.parametrize(
    "viewport", [{"width": 1280, "height": 900}, {"width": 390, "height": 844}], ids=["1280", "390"]
)
def test_a_user_with_more_than_a_page_of_threads_reaches_the_oldest_R_UI_1(web_url, chat_user, browser, viewport):
    """A newcomer with more than 100 threads could not reach the older ones:
    "Show more threads" lists the next page below, and the list keeps it
    when a thread is archived."""
    width = viewport["width"]
    threads = [
        Conversation.objects.create(
            user=chat_user, agent_id="assistant", model="replay:plain_answer", title=f"Thread {i:03}"
        )
        for i in range(1, 106)
    ]
    newest_first = [str(thread.id) for thread in reversed(threads)]
    context, page, watch = _open_chat(browser, web_url, viewport, chat_user)
    try:
        page.wait_for_selector("#yc-thread-list .yc-thread")
        assert _listed(page) == newest_first[:100]
        more = page.get_by_role("button", name="Show more threads")
        assert more.is_visible()
        more.click()
        page.wait_for_function("() => document.querySelectorAll('#yc-thread-list .yc-thread').length === 105")
        assert _listed(page) == newest_first
        assert more.is_hidden()
        # Focus is on the first thread of the page just listed.
        assert page.evaluate("() => document.activeElement.dataset.threadId") == newest_first[100]
        assert page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")
        page.screenshot(path=SCREENSHOTS / f"chat-more-threads-{width}.png")

        # The oldest opens; archived, it leaves the list, which keeps the
        # threads of its second page.
        oldest = page.locator(f".yc-thread[data-thread-id='{newest_first[-1]}']")
        oldest.click()
        page.wait_for_function("() => document.getElementById('yc-thread-title').textContent === 'Thread 001'")
        page.wait_for_selector("#yc-input:enabled")
        page.get_by_role("button", name="Archive", exact=True).click()
        page.wait_for_function("() => document.querySelectorAll('#yc-thread-list .yc-thread').length === 104")
        assert _listed(page) == newest_first[:-1]
        assert more.is_hidden()

        # A reload lists the first page again.
        page.reload()
        page.wait_for_function("() => document.querySelectorAll('#yc-thread-list .yc-thread').length === 100")
        assert more.is_visible()
        watch.check()
    finally:
        context.close()
        _close_orm_connection()


#: A thread title of one unbroken word: the server names a thread after the
#: first words of its first message, which may be a long URL.
LONG_TITLE = "https://example.com/" + "a" * 130


@pytest.mark.parametrize(
    "viewport", [{"width": 1280, "height": 900}, {"width": 390, "height": 844}], ids=["1280", "390"]
)
def test_a_thread_titled_by_a_long_url_keeps_the_page_readable_R_UI_1(chat_stack, chat_user, browser, viewport):
    """A newcomer found that a title of one long word widened the thread
    list to ~1700 px at 1280 px: the page scrolled sideways and the list
    covered Send. The list keeps its width and cuts the title with "…", the
    conversation's head wraps it, and Send takes a real click."""
    width = viewport["width"]
    assert len(LONG_TITLE) == 150 and " " not in LONG_TITLE
    thread = Conversation.objects.create(
        user=chat_user, agent_id="assistant", model="replay:plain_answer", title=LONG_TITLE
    )
    context, page, watch = _open_chat(browser, chat_stack.base_url, viewport, chat_user)
    try:
        listed = page.locator(f".yc-thread[data-thread-id='{thread.id}']")
        listed.click()
        page.wait_for_selector("#yc-input:enabled")
        assert page.locator("#yc-thread-title").inner_text() == LONG_TITLE
        side = page.locator(".yc-side").bounding_box()
        if width >= 800:
            assert abs(side["width"] - 18 * 16) <= 1, side  # 18rem
        else:
            assert side["width"] <= width, side
        # The list cuts the title ("…" from text-overflow): it overflows its
        # button, which clips it.
        assert listed.evaluate("b => b.scrollWidth > b.clientWidth && getComputedStyle(b).textOverflow === 'ellipsis'")
        # The head wraps the title within the conversation column.
        main = page.locator(".yc-main").bounding_box()
        title = page.locator("#yc-thread-title").bounding_box()
        assert main["width"] >= (width - 18 * 16 - 3 * 16 if width >= 800 else width - 2 * 16) - 1, main
        assert title["x"] >= main["x"] and title["x"] + title["width"] <= main["x"] + main["width"] + 0.5, title
        # Readable at this width: the page never scrolls sideways.
        assert page.evaluate("() => document.documentElement.scrollWidth <= document.documentElement.clientWidth")
        page.screenshot(path=SCREENSHOTS / f"chat-long-title-{width}.png")
        # The delete dialog quotes the title: it wraps there too.
        page.get_by_role("button", name="Delete", exact=True).click()
        dialog = page.locator("#yc-delete-dialog")
        dialog.wait_for()
        assert dialog.evaluate("d => d.scrollWidth <= d.clientWidth"), dialog.evaluate("d => d.scrollWidth")
        page.click("#yc-delete-keep")
        dialog.wait_for(state="hidden")

        # Send takes a real click (nothing covers it) and the answer comes.
        page.fill("#yc-input", "Hello")
        page.click("#yc-send-button", timeout=5_000)
        page.wait_for_function(
            "() => document.querySelectorAll('#yc-messages > li[data-kind=answer]').length === 1"
            " && document.getElementById('yc-app').dataset.runStatus === 'completed'"
        )
        assert page.evaluate("() => document.documentElement.scrollWidth <= document.documentElement.clientWidth")
        watch.check()
    finally:
        context.close()
        _close_orm_connection()
