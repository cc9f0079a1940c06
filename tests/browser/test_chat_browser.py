"""The chat page in a real browser (R-UI-1, R-SEC-1): a user who is not
staff signs in, creates a thread, sends a message, watches the answer
stream in with its tool call, and finds both messages in the history;
a long answer is cancelled from the page. Real processes: uvicorn, a Celery
worker and the replay model server (tests/e2e/stack.py), Chromium through
Playwright. No console error and no Content Security Policy violation."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.db import connection

from audit.replay.scenarios import load_scenarios
from tests.e2e.stack import database_url_of, start_stack

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
    """A page's console errors, uncaught exceptions and CSP violations."""

    def __init__(self, page):
        self.page = page
        self.errors: list[str] = []
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        page.on("console", lambda m: m.type == "error" and self.errors.append(f"console: {m.text}"))
        page.on("response", lambda r: r.status >= 400 and self.errors.append(f"{r.status}: {r.url}"))

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


@pytest.mark.parametrize(
    "viewport", [{"width": 1280, "height": 900}, {"width": 390, "height": 844}], ids=["1280", "390"]
)
def test_a_user_chats_and_sees_the_answer_stream_in_R_UI_1(chat_stack, chat_user, browser, viewport):
    width = viewport["width"]
    context, page, watch = _open_chat(browser, chat_stack.base_url, viewport, chat_user)
    try:
        assert page.locator("#yc-admin-link").count() == 0  # not staff
        # The select offers what POST /api/threads accepts.
        assert "replay:tool_then_answer" in page.locator("#yc-model option").all_inner_texts()
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
        page.screenshot(path=SCREENSHOTS / "chat-cancelled-1280.png")
        watch.check()
    finally:
        context.close()
