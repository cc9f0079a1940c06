"""Admin console (R-ADM-1, R-DASH-1): who may see it, read-only audit rows,
the run timeline with its truncation and paging, and query counts that do
not grow with the number of rows."""

from __future__ import annotations

import re
import time
from html.parser import HTMLParser

import pytest
from django.urls import reverse

from audit.models import AgentRun
from conversations.models import ApiToken, Conversation, Message, MessageFeedback

from .builders import STATUSES, big_run

pytestmark = pytest.mark.django_db


def run_page(run) -> str:
    return reverse("admin:audit_agentrun_change", args=[run.pk])


def admin_urls(thread, run, message) -> list[str]:
    return [
        reverse("admin:index"),
        reverse("admin-dashboard"),
        reverse("admin:audit_agentrun_changelist"),
        run_page(run),
        reverse("admin:audit_agentrun_timeline", args=[run.pk]),
        reverse("admin:conversations_conversation_changelist"),
        reverse("admin:conversations_conversation_change", args=[thread.pk]),
        reverse("admin:conversations_conversation_timeline", args=[thread.pk]),
        reverse("admin:conversations_message_changelist"),
        reverse("admin:conversations_message_change", args=[message.pk]),
        reverse("admin:conversations_messagefeedback_changelist"),
        reverse("admin:conversations_apitoken_changelist"),
    ]


@pytest.fixture
def small_run(thread):
    return big_run(thread, rows=12)


def test_non_staff_reach_nothing_of_the_admin_R_ADM_1_R_READ_5(client, user, thread, small_run):
    message = Message.objects.filter(run=small_run).first()
    client.force_login(user)  # an ordinary, active user
    for url in admin_urls(thread, small_run, message):
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith(reverse("admin:login")), url
    client.logout()
    for url in admin_urls(thread, small_run, message):
        assert client.get(url).status_code == 302, url


def test_staff_superuser_reaches_every_page_R_ADM_1(client, staff_user, thread, small_run):
    message = Message.objects.filter(run=small_run).first()
    client.force_login(staff_user)
    for url in admin_urls(thread, small_run, message):
        assert client.get(url).status_code == 200, url


def test_staff_without_model_permissions_cannot_read_runs_R_ADM_1(client, django_user_model, thread, small_run):
    plain_staff = django_user_model.objects.create_user(username="plain-staff", password="pw-12345678", is_staff=True)
    client.force_login(plain_staff)
    assert client.get(run_page(small_run)).status_code in (302, 403)
    assert client.get(reverse("admin:audit_agentrun_timeline", args=[small_run.pk])).status_code == 403
    assert client.get(reverse("admin:conversations_conversation_timeline", args=[thread.pk])).status_code == 403


def test_audit_rows_are_read_only_in_the_admin_R_ADM_1(client, staff_user, small_run):
    client.force_login(staff_user)
    row = Message.objects.filter(run=small_run).first()
    before = Message.objects.get(pk=row.pk).content
    change = reverse("admin:conversations_message_change", args=[row.pk])
    assert client.post(change, {"content": "tampered"}).status_code == 403
    assert client.post(reverse("admin:conversations_message_delete", args=[row.pk]), {"post": "yes"}).status_code == 403
    assert client.get(reverse("admin:conversations_message_add")).status_code == 403
    changelist = client.post(
        reverse("admin:conversations_message_changelist"),
        {"action": "delete_selected", "_selected_action": [row.pk], "post": "yes"},
    )
    assert changelist.status_code in (200, 302)
    assert Message.objects.get(pk=row.pk).content == before
    # Runs too: workers write them, the admin only reads.
    assert client.post(run_page(small_run), {"status": "failed"}).status_code == 403
    assert client.get(reverse("admin:audit_agentrun_add")).status_code == 403
    assert AgentRun.objects.get(pk=small_run.pk).status == "completed"


def test_run_page_shows_every_status_kind_waterfall_and_turn_R_ADM_1(client, staff_user, thread, small_run):
    resume = AgentRun.objects.create(
        request_id="resume-of-small",
        thread=thread,
        turn_id=small_run.turn_id,
        resumed_from=small_run,
        user=thread.user,
        agent_id="assistant",
        model=thread.model,
        status="completed",
    )
    client.force_login(staff_user)
    html = client.get(run_page(small_run)).content.decode()
    assert set(re.findall(r'data-status="(\w+)"', html)) == set(STATUSES)
    assert {"model", "tool"} == set(re.findall(r'data-kind="(\w+)"', html))
    assert html.count('class="yx-bar') == 11  # the rejected tool call never started: no bar
    assert "never started" in html
    assert "declared tool calls" in html and "raw tool output" in html and "raw envelope 2" in html
    assert "Truncated" not in html
    assert run_page(resume) in html and "resume" in html
    assert 'data-live="0"' in html


def test_run_page_shows_the_timeline_above_the_field_sets_R_ADM_1(client, staff_user, small_run):
    """The timeline is what the page is read for: at the top, not below
    the run's fields (issue 37)."""
    client.force_login(staff_user)
    html = client.get(run_page(small_run)).content.decode()
    timeline = html.index('id="yx-timeline-title"')
    assert html.count('id="yx-timeline"') == 1
    assert timeline < html.index('<fieldset class="module aligned')
    assert timeline < html.index(" field-status_display")
    assert html.index('id="yx-timeline"') < html.index('id="yx-replays-title"')


class _Forms(HTMLParser):
    """The action of each form of a page with the number of forms open
    around it."""

    def __init__(self):
        super().__init__()
        self.open = 0
        self.found: list[tuple[str, int]] = []

    def handle_starttag(self, tag, attrs):
        if tag == "form":
            self.found.append((dict(attrs).get("action") or "", self.open))
            self.open += 1

    def handle_endtag(self, tag):
        if tag == "form":
            self.open -= 1


def test_the_replay_form_is_not_inside_the_change_form_R_REPLAY_2(client, staff_user, small_run):
    """A form inside a form is dropped by the browser, and its button
    submits the outer one: the Replay button sent the change form."""
    client.force_login(staff_user)
    parser = _Forms()
    parser.feed(client.get(run_page(small_run)).content.decode())
    replay = reverse("admin:audit_agentrun_replay", args=[small_run.pk])
    assert (replay, 0) in parser.found, parser.found


def test_live_run_page_refreshes_itself_R_ADM_1(client, staff_user, thread):
    run = big_run(thread, rows=4, status=AgentRun.Status.RUNNING)
    client.force_login(staff_user)
    html = client.get(run_page(run)).content.decode()
    assert 'data-live="1"' in html and "audit/timeline.js" in html
    fragment = client.get(reverse("admin:audit_agentrun_timeline", args=[run.pk])).content.decode()
    assert fragment.lstrip().startswith('<div id="yx-timeline"') or 'id="yx-timeline"' in fragment
    assert fragment.count('<tr class="yx-row ') == 4


def test_timeline_truncates_at_500_and_pages_back_R_ADM_1_R_READ_3(client, staff_user, thread):
    run = big_run(thread, rows=620)
    client.force_login(staff_user)
    html = client.get(run_page(run)).content.decode()
    assert "Truncated" in html
    sequences = [int(s) for s in re.findall(r'<td class="yx-seq">(\d+)</td>', html)]
    assert sequences == list(range(121, 621))  # the newest 500, in sequence order
    older = re.search(r'class="yx-older" href="([^"]+)"', html).group(1).replace("&amp;", "&")
    older_html = client.get(older).content.decode()
    assert [int(s) for s in re.findall(r'<td class="yx-seq">(\d+)</td>', older_html)] == list(range(1, 121))
    assert "Truncated" not in older_html and 'class="yx-newest"' in older_html
    assert 'data-live="0"' in older_html


def test_thread_timeline_in_admin_R_ADM_1(client, staff_user, thread, small_run):
    client.force_login(staff_user)
    conversation = client.get(reverse("admin:conversations_conversation_change", args=[thread.pk])).content.decode()
    timeline_url = reverse("admin:conversations_conversation_timeline", args=[thread.pk])
    assert timeline_url in conversation
    html = client.get(timeline_url).content.decode()
    assert html.count('<tr class="yx-row ') == 12 and run_page(small_run) in html


def test_run_changelist_queries_do_not_grow_with_rows_R_ADM_1(
    client, staff_user, django_user_model, django_assert_max_num_queries
):
    client.force_login(staff_user)
    url = reverse("admin:audit_agentrun_changelist")
    for i in range(30):
        owner = django_user_model.objects.create_user(username=f"u{i}")
        thread = Conversation.objects.create(user=owner, agent_id="assistant", model="replay:plain_answer")
        big_run(thread, rows=12)
    with django_assert_max_num_queries(8):
        response = client.get(url)
    html = response.content.decode()
    assert html.count('class="yx-badge') >= 30
    # Counts per run come from the audit rows: 6 model calls, 5 tool
    # executions (the sixth tool row was rejected, it never started).
    assert re.search(r'<td class="field-calls"><span title="6 model calls, 5 tool executions">6 / 5</span></td>', html)
    for path in (
        f"{url}?status=completed",
        f"{url}?agent=assistant",
        f"{url}?model=replay:plain_answer",
        f"{url}?q=not-a-request-id",
        f"{url}?_facets=True",  # no facet counts on this table
    ):
        with django_assert_max_num_queries(8):
            assert client.get(path).status_code == 200


def test_run_changelist_search_is_exact_on_ids_R_ADM_1(client, staff_user, thread, small_run):
    client.force_login(staff_user)
    url = reverse("admin:audit_agentrun_changelist")
    for term in (str(small_run.pk), small_run.request_id, str(thread.pk)):
        html = client.get(url, {"q": term}).content.decode()
        assert str(small_run.pk)[:8] in html, term
    assert str(small_run.pk)[:8] not in client.get(url, {"q": small_run.request_id[:6]}).content.decode()


def test_other_changelists_have_bounded_queries_R_ADM_1(
    client, staff_user, thread, small_run, django_assert_max_num_queries
):
    client.force_login(staff_user)
    ApiToken.objects.issue(user=thread.user, name="t")
    for row in Message.objects.filter(run=small_run)[:5]:
        MessageFeedback.objects.create(message=row, user=thread.user, rating="like")
    for name in (
        "conversations_conversation",
        "conversations_message",
        "conversations_messagefeedback",
        "conversations_apitoken",
    ):
        with django_assert_max_num_queries(8):
            assert client.get(reverse(f"admin:{name}_changelist")).status_code == 200, name


def test_run_with_20000_calls_first_page_is_bounded_R_ADM_1(client, staff_user, thread, django_assert_max_num_queries):
    """The first page of a 20,000-row run: a fixed number of queries; the
    time is printed as a figure, not asserted."""
    run = big_run(thread, rows=20_000)
    client.force_login(staff_user)
    started = time.perf_counter()
    # session, user, run, turn, timeline page (+ savepoints of the view)
    with django_assert_max_num_queries(9):
        response = client.get(run_page(run))
    elapsed_ms = (time.perf_counter() - started) * 1000
    html = response.content.decode()
    assert "Truncated" in html and html.count('<tr class="yx-row ') == 500
    print(f"\nbenchmark: run page with 20,000 audit rows rendered its first 500 in {elapsed_ms:.0f} ms")


def test_api_token_issued_in_admin_shows_plaintext_once(client, staff_user, user):
    client.force_login(staff_user)
    response = client.post(reverse("admin:conversations_apitoken_add"), {"user": user.pk, "name": "ci"}, follow=True)
    assert response.status_code == 200
    token = ApiToken.objects.get(user=user, name="ci")
    shown = re.search(r"(yx_[A-Za-z0-9_-]+)", response.content.decode()).group(1)
    assert ApiToken.digest(shown) == token.key_digest


def test_dashboard_page_embeds_figures_and_vendored_chart_library_R_DASH_1(client, staff_user):
    client.force_login(staff_user)
    html = client.get(reverse("admin-dashboard"), {"tz": "Asia/Shanghai"}).content.decode()
    assert "vendor/chartjs/chart.umd.min.js" in html
    # Nothing is loaded from another origin (a CSRF token may spell "cdn" by chance).
    sources = re.findall(r"""<(?:script|link|img)\b[^>]*\b(?:src|href)=["']([^"']+)""", html, re.I)
    assert sources and not [s for s in sources if s.startswith(("http:", "https:", "//"))]
    assert 'id="yx-dashboard-data"' in html and html.count("<canvas") == 9
    bad = client.get(reverse("admin-dashboard"), {"tz": "No/Where"}).content.decode()
    assert "unknown time zone" in bad
