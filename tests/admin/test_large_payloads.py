"""Large payloads on the admin's timelines (R-ADM-1, issue 37): the run
page carries a bounded preview of each payload, and the whole text loads
from a staff-only admin view when the row is expanded."""

from __future__ import annotations

import json

import pytest
from django.urls import reverse

from audit.admin import PAYLOAD_PREVIEW_CHARS
from conversations.models import Message

from .builders import big_result_run

pytestmark = pytest.mark.django_db


def payload_url(row: Message, part: str) -> str:
    return reverse("admin:audit_agentrun_payload", args=[row.run_id, row.pk, part])


def test_run_page_with_a_million_character_result_is_small_R_ADM_1(client, staff_user, thread):
    run, rows = big_result_run(thread, results=3)
    client.force_login(staff_user)
    html = client.get(reverse("admin:audit_agentrun_change", args=[run.pk])).content.decode()
    assert len(html.encode()) < 200_000
    for row in rows:
        # Content, tool input and raw output are each cut, with the link to the whole text.
        for part in ("content", "tool_input", "raw_output"):
            assert f'href="{payload_url(row, part)}" data-yx-full="{part}"' in html
        assert f"first {PAYLOAD_PREVIEW_CHARS:,} of {len(row.content):,} characters" in html
    assert "THE END" not in html
    assert html.count('class="yx-cut"') == 9
    # The live fragment and the thread timeline carry the previews too.
    fragment = client.get(reverse("admin:audit_agentrun_timeline", args=[run.pk])).content
    assert len(fragment) < 200_000
    thread_page = client.get(reverse("admin:conversations_conversation_timeline", args=[thread.pk])).content
    assert len(thread_page) < 200_000 and thread_page.count(b'class="yx-cut"') == 9


def test_whole_payload_loads_from_the_admin_view_R_ADM_1(client, staff_user, thread):
    run, (row,) = big_result_run(thread)
    client.force_login(staff_user)
    response = client.get(payload_url(row, "content"))
    assert response.status_code == 200
    assert response["Content-Type"] == "text/plain; charset=utf-8"
    assert "no-store" in response["Cache-Control"]
    assert response.content.decode() == row.content
    raw = json.loads(client.get(payload_url(row, "raw_output")).content)
    assert raw["content"] == row.content and raw["tool_call_id"] == row.operation_id
    assert json.loads(client.get(payload_url(row, "tool_input")).content) == row.tool_input
    assert client.get(payload_url(row, "tool_calls")).content == b""  # a tool row declares none
    assert client.get(reverse("admin:audit_agentrun_payload", args=[run.pk, row.pk, "secret"])).status_code == 404
    other, _ = big_result_run(thread)
    assert client.get(reverse("admin:audit_agentrun_payload", args=[other.pk, row.pk, "content"])).status_code == 404


def test_whole_payload_is_for_staff_only_R_ADM_1_R_READ_5(client, django_user_model, user, thread):
    _, (row,) = big_result_run(thread)
    url = payload_url(row, "raw_output")
    login = reverse("admin:login")
    response = client.get(url)  # anonymous
    assert response.status_code == 302 and response["Location"].startswith(login)
    client.force_login(user)  # the run's own user, not staff
    response = client.get(url)
    assert response.status_code == 302 and response["Location"].startswith(login)
    plain_staff = django_user_model.objects.create_user(username="plain-staff", password="pw-12345678", is_staff=True)
    client.force_login(plain_staff)  # staff without permission on runs
    assert client.get(url).status_code == 403
