"""The chat page's server side (R-UI-1, R-SEC-1): it needs a signed-in
user, any active user can sign in for it, it carries its data for the
script without an inline script, and the admin's "View site" leads to it."""

from __future__ import annotations

import json
import re
import uuid

import pytest

from audit.catalogue import available_models, chat_models
from audit.replay.scenarios import load_scenarios
from core.config import get_config

pytestmark = pytest.mark.django_db


def test_chat_needs_a_signed_in_user_R_UI_1(client):
    response = client.get("/chat/")
    assert response.status_code == 302
    assert response["Location"] == "/chat/login/?next=/chat/"


def test_a_user_who_is_not_staff_signs_in_and_gets_the_page_R_UI_1(client, user):
    login = client.get("/chat/login/?next=/chat/")
    assert login.status_code == 200
    assert "script-src 'self'" in login["Content-Security-Policy"]
    signed_in = client.post("/chat/login/", {"username": user.username, "password": "pw-12345678", "next": "/chat/"})
    assert signed_in.status_code == 302 and signed_in["Location"] == "/chat/"
    # Without `next`, the sign-in also leads to the chat.
    client.logout()
    signed_in = client.post("/chat/login/", {"username": user.username, "password": "pw-12345678"})
    assert signed_in["Location"] == "/chat/"

    page = client.get("/chat/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "script-src 'self'" in page["Content-Security-Policy"]
    assert page.cookies.get("csrftoken"), "the page sets the CSRF cookie its script's writes need"
    # One script, from this origin; the only other <script> is json_script's data.
    scripts = re.findall(r"<script([^>]*)>", html)
    assert scripts == [' src="/static/chat/chat.js" defer', ' id="yc-config" type="application/json"'], scripts
    assert not re.search(r"\son[a-z]+=", html), "no inline event handler (the CSP blocks them)"
    config = json.loads(re.search(r'<script id="yc-config" type="application/json">(.*?)</script>', html).group(1))
    assert config == {
        "agent_id": "assistant",
        "models": chat_models(),
        "default_model": get_config().DEFAULT_MODEL,
    }
    assert 'data-csrf-token="' in html
    # Staff only see the admin link.
    assert 'id="yc-admin-link"' not in html


def test_staff_get_a_link_to_the_admin_and_the_admin_links_to_the_chat_R_UI_1(client, staff_user):
    client.force_login(staff_user)
    page = client.get("/chat/")
    assert 'id="yc-admin-link" href="/admin/"' in page.content.decode()
    admin_index = client.get("/admin/")
    assert '<a href="/chat/">View site</a>' in admin_index.content.decode()


def test_a_signed_in_user_is_sent_on_from_the_sign_in_page_R_UI_1(client, user):
    client.force_login(user)
    assert client.get("/chat/login/")["Location"] == "/chat/"
    signed_out = client.post("/chat/logout/")
    assert signed_out["Location"] == "/chat/login/"
    assert client.get("/chat/").status_code == 302


def test_the_static_files_are_found_R_UI_1(client):
    from django.contrib.staticfiles import finders

    assert finders.find("chat/chat.js") and finders.find("chat/chat.css")


def test_the_quick_starts_demo_prints_the_chat_url_R_UI_1(monkeypatch, capsys):
    from django.core.management import call_command

    from audit.demo import DemoRun
    from audit.management.commands import demo

    run = DemoRun(
        model="replay:plain_answer",
        run_id=str(uuid.uuid4()),
        thread_id=str(uuid.uuid4()),
        status="completed",
        model_calls=1,
        tool_calls=0,
        total_tokens=10,
    )
    monkeypatch.setattr(demo, "run_demo", lambda **kwargs: [run])
    call_command("demo", "--base-url", "http://127.0.0.1:8123")
    assert "chat:         http://127.0.0.1:8123/chat/   (sign in as admin)" in capsys.readouterr().out


def test_the_page_has_the_thread_actions_hidden_until_a_thread_is_open_R_UI_1(client, user):
    """Rename, archive and delete (R-API-1) wait for chat.js to open a
    thread; the rename field has a label and the deletion its dialog."""
    client.force_login(user)
    html = client.get("/chat/").content.decode()
    assert '<div id="yc-thread-actions" class="yc-thread-actions" role="group" aria-label="Thread" hidden>' in html
    assert '<form id="yc-rename" class="yc-rename" aria-label="Rename the thread" hidden>' in html
    assert '<label for="yc-rename-input" class="yc-visually-hidden">Thread title</label>' in html
    assert re.search(r'<dialog id="yc-delete-dialog"[^>]*aria-labelledby="yc-delete-heading"', html)
    assert '<input type="checkbox" id="yc-show-archived"> Show archived threads' in html


#: The bundled scenarios meant for a person to try in the chat (R-UI-1).
CHAT_SCENARIOS = {
    "replay:plain_answer",
    "replay:long_answer",
    "replay:slow_answer",
    "replay:tool_then_answer",
    "replay:two_tools_then_answer",
    "replay:parallel_tools_then_answer",
    "replay:approval_send_email",
    "replay:tool_error_handled",
}


@pytest.fixture
def environ(monkeypatch):
    """Sets environment variables for one test; the configuration is read
    again with them, and again without them after."""

    def setenv(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)
        get_config.cache_clear()

    yield setenv
    monkeypatch.undo()
    get_config.cache_clear()


def test_the_model_select_offers_the_scenarios_meant_for_a_person_R_UI_1(client, user, environ):
    """A newcomer found all 37 replay scenarios in the select, fault ones
    such as ``replay:model_unreachable`` among them: the select offers the
    scenarios marked ``"chat": true``, each with its description, and the
    configured ``MODELS``; the API still accepts every available model."""
    environ(MODELS="openai:gpt-4o-mini")
    client.force_login(user)
    html = client.get("/chat/").content.decode()
    config = json.loads(re.search(r'<script id="yc-config" type="application/json">(.*?)</script>', html).group(1))
    names = [model["name"] for model in config["models"]]
    assert set(names) == CHAT_SCENARIOS | {"openai:gpt-4o-mini"}
    assert names[-1] == "openai:gpt-4o-mini"
    for internal in ("replay:model_unreachable", "replay:unstorable_surrogates", "replay:reused_call_id_email_alpha"):
        assert internal not in names and internal in available_models()
    scenarios = load_scenarios()
    for model in config["models"][:-1]:
        assert model["description"] == scenarios[model["name"].removeprefix("replay:")].description != ""
    assert config["models"][-1] == {"name": "openai:gpt-4o-mini", "description": ""}
    assert set(names) <= set(available_models())
    # A thread on a scenario the select leaves out is still accepted.
    created = client.post(
        "/api/threads", {"agent_id": "assistant", "model": "replay:model_unreachable"}, content_type="application/json"
    )
    assert created.status_code == 201, created.content


def test_the_default_model_is_offered_even_when_not_meant_for_the_chat_R_UI_1(client, user, environ):
    environ(DEFAULT_MODEL="replay:large_lookup")
    client.force_login(user)
    html = client.get("/chat/").content.decode()
    config = json.loads(re.search(r'<script id="yc-config" type="application/json">(.*?)</script>', html).group(1))
    assert config["default_model"] == "replay:large_lookup"
    assert config["models"][0] == {"name": "replay:large_lookup", "description": ""}
    assert {model["name"] for model in config["models"][1:]} == CHAT_SCENARIOS
