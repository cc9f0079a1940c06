"""The chat page's server side (R-UI-1, R-SEC-1): it needs a signed-in
user, any active user can sign in for it, it carries its data for the
script without an inline script, and the admin's "View site" leads to it."""

from __future__ import annotations

import json
import re
import uuid

import pytest

from audit.catalogue import available_models
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
        "models": available_models(),
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
