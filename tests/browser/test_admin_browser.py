"""The admin console in a real browser (R-ADM-1, R-DASH-1): log in as
staff, open a run with model and tool rows in all six execution statuses,
expand a row, page back past 500 rows, open the dashboard and see its
charts drawn; at desktop width and at 390 px, in light and dark themes."""

from __future__ import annotations

import datetime as dt

import httpx
import psycopg
import pytest
from django.db import connection
from django.utils import timezone

from audit.models import AgentRun
from conversations.models import Conversation
from tests.admin.builders import BIG_RESULT, STATUSES, big_result_run, big_run
from tests.dashboard.world import build_world

from .conftest import SCREENSHOTS

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PASSWORD = "pw-browser-1234"
VIEWS = [
    pytest.param({"width": 1280, "height": 900}, "light", id="desktop-light"),
    pytest.param({"width": 1280, "height": 900}, "dark", id="desktop-dark"),
    pytest.param({"width": 390, "height": 844}, "light", id="phone-light"),
    pytest.param({"width": 390, "height": 844}, "dark", id="phone-dark"),
]


def test_static_files_are_served_by_the_asgi_server_R_ADM_1(web_url):
    with httpx.Client(base_url=web_url) as client:
        for path in (
            "/static/admin/css/base.css",
            "/static/vendor/chartjs/chart.umd.min.js",
            "/static/audit/timeline.css",
            "/static/dashboard/dashboard.js",
            "/static/dashboard/palette.js",
            "/static/audit/scroll.css",
            "/static/audit/scroll.js",
        ):
            assert client.get(path).status_code == 200, path


@pytest.fixture
def admin_world(django_user_model, user, other_user):
    staff = django_user_model.objects.create_user(
        username="browser-staff", password=PASSWORD, is_staff=True, is_superuser=True
    )
    # Yesterday: inside the dashboard's default window (the last 30 days).
    build_world(user, other_user, day=timezone.now().date() - dt.timedelta(days=1))
    thread = user.conversations.first()
    run = big_run(thread, rows=620)
    resume = AgentRun.objects.create(
        request_id="browser-resume",
        thread=thread,
        turn_id=run.turn_id,
        resumed_from=run,
        user=user,
        agent_id="assistant",
        model=thread.model,
        status=AgentRun.Status.RUNNING,
    )
    live = big_run(thread, rows=3, status=AgentRun.Status.RUNNING)
    return staff, run, resume, live


def insert_model_row(run, *, sequence: int) -> None:
    """Write a running model row the way a worker's transaction would: from
    another connection, committed (the ORM is not used while Playwright's
    event loop runs in this thread)."""
    s = connection.settings_dict
    with psycopg.connect(
        dbname=s["NAME"],
        user=s.get("USER") or None,
        host=s.get("HOST") or "127.0.0.1",
        port=s.get("PORT") or 5432,
        autocommit=True,
    ) as conn:
        conn.execute(
            """INSERT INTO conversations_message (thread_id, run_id, role, message_type, content, metadata, tool_name,
                   operation_id, sequence, execution_status, started_at, created_at, updated_at)
               VALUES (%s, %s, 'assistant', 'model_audit', '', '{}'::jsonb, '', %s, %s, 'running', now(), now(), now())""",
            [run.thread_id, run.pk, f"lc_run--live-{sequence}", sequence],
        )


def finish_run(run) -> None:
    """End a run the way the terminal transaction would, from another
    connection (committed)."""
    s = connection.settings_dict
    with psycopg.connect(
        dbname=s["NAME"],
        user=s.get("USER") or None,
        host=s.get("HOST") or "127.0.0.1",
        port=s.get("PORT") or 5432,
        autocommit=True,
    ) as conn:
        conn.execute(
            """UPDATE audit_agentrun SET status = 'completed', finished_at = started_at + interval '4 seconds',
                   usage = '{"input_tokens": 30, "output_tokens": 12, "total_tokens": 42, "unknown_calls": 0}'::jsonb
               WHERE id = %s""",
            [run.pk],
        )


def _no_horizontal_scroll(page) -> bool:
    """Neither the page nor the changelist's own scroll box (Django's
    ``.results``) needs horizontal scrolling: every column is visible."""
    widths = page.evaluate(
        """() => [[document.documentElement.scrollWidth, window.innerWidth],
                  ...[...document.querySelectorAll('.results')].map(e => [e.scrollWidth, e.clientWidth])]"""
    )
    assert all(needed <= shown for needed, shown in widths), widths
    return True


@pytest.mark.parametrize(("viewport", "scheme"), VIEWS)
def test_staff_reads_a_run_timeline_and_the_dashboard_R_ADM_1_R_DASH_1(web_url, admin_world, browser, viewport, scheme):
    staff, run, resume, live = admin_world
    name = f"{viewport['width']}-{scheme}"
    context = browser.new_context(viewport=viewport, color_scheme=scheme, base_url=web_url)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        _sign_in(page, staff)
        assert page.locator("#yx-dashboard-link").is_visible()

        # The run list: counts per run, status badges, filters. At 1280 px
        # its columns fit beside the filters: no horizontal scrolling.
        page.goto("/admin/audit/agentrun/")
        assert page.locator("#result_list tbody tr").count() == 5
        assert page.locator("#changelist-filter").count() == 1
        page.screenshot(path=SCREENSHOTS / f"runs-{name}.png", full_page=True)
        if viewport["width"] >= 1280:
            assert _no_horizontal_scroll(page), "run list"
        # Filtered by a tool and searched by words of the audit (R-ADM-2).
        page.goto("/admin/audit/agentrun/?tool=get_weather&q=lorem")
        assert page.locator("#result_list tbody tr").count() == 2  # the two big runs
        page.screenshot(path=SCREENSHOTS / f"runs-filtered-{name}.png", full_page=False)
        page.goto("/admin/conversations/message/")
        page.screenshot(path=SCREENSHOTS / f"messages-{name}.png", full_page=False)
        if viewport["width"] >= 1280:
            assert _no_horizontal_scroll(page), "message list"

        # The run page: newest 500 rows, every status, the truncation notice.
        page.goto(f"/admin/audit/agentrun/{run.pk}/change/")
        rows = page.locator("#yx-timeline tr.yx-row")
        assert rows.count() == 500
        for status in STATUSES:
            assert page.locator(f"#yx-timeline tr.yx-row[data-status='{status}'] .yx-badge").first.is_visible(), status
        assert page.locator(".yx-truncated").is_visible()
        # Styled by the admin CSS served from the ASGI process.
        assert page.locator("#header").evaluate("e => getComputedStyle(e).display") == "flex"
        page.screenshot(path=SCREENSHOTS / f"run-{name}.png", full_page=False)
        page.locator("#yx-timeline-title").scroll_into_view_if_needed()
        page.screenshot(path=SCREENSHOTS / f"run-timeline-{name}.png", full_page=False)

        # Expand a tool row: content, input and raw output show.
        tool_id = page.locator("#yx-timeline tr.yx-row[data-kind='tool'][data-status='completed']").first.get_attribute(
            "data-id"
        )
        tool_details = page.locator(f"#yx-timeline tr.yx-detail[data-id='{tool_id}']")
        tool_details.locator("summary").click()
        raw = tool_details.locator(".yx-raw")
        assert raw.is_visible() and "raw envelope" in raw.inner_text()
        model_id = page.locator("#yx-timeline tr.yx-row[data-kind='model']").first.get_attribute("data-id")
        model_details = page.locator(f"#yx-timeline tr.yx-detail[data-id='{model_id}']")
        model_details.locator("summary").click()
        assert model_details.locator(".yx-declared").is_visible()
        tool_details.scroll_into_view_if_needed()
        page.screenshot(path=SCREENSHOTS / f"run-expanded-{name}.png")

        # Turn: the resume run is linked from the original.
        assert page.locator(f"a[href='/admin/audit/agentrun/{resume.pk}/change/']").count() >= 1

        # Page back beyond 500: the 120 oldest rows.
        page.click("a.yx-older")
        page.wait_for_selector("a.yx-newest")
        assert page.locator("#yx-timeline tr.yx-row").count() == 120
        assert page.locator("#yx-timeline td.yx-seq").first.inner_text() == "1"
        page.locator(".yx-newest").scroll_into_view_if_needed()
        page.screenshot(path=SCREENSHOTS / f"run-older-{name}.png")

        # A live run's timeline refreshes itself: a row a worker writes now
        # appears without a reload.
        page.goto(f"/admin/audit/agentrun/{live.pk}/change/")
        assert page.locator("#yx-timeline tr.yx-row").count() == 3
        assert page.locator(".yx-live").is_visible()
        insert_model_row(live, sequence=4)
        page.wait_for_selector("#yx-timeline tr.yx-row[data-id] >> nth=3", timeout=15_000)
        assert page.locator("#yx-timeline td.yx-seq").nth(3).inner_text() == "4"
        # The header too: when the run ends, its status, usage and duration
        # change without a reload.
        header_status = page.locator(".field-status_display [data-yx-live='status']")
        assert "running" in header_status.inner_text()
        assert "(running)" in page.title()
        assert "(running)" in page.locator("#content h2").first.inner_text()
        finish_run(live)
        page.wait_for_selector(".field-status_display [data-yx-live='status'] .yx-status-completed", timeout=15_000)
        assert "= 42" in page.locator(".field-usage_text [data-yx-live='usage']").inner_text()
        assert "running" not in page.locator(".field-duration [data-yx-live='duration']").inner_text()
        # ... and so do the page title, heading and breadcrumbs that name it.
        assert f"run {live.pk} (completed)" in page.title(), page.title()
        assert "(running)" not in page.locator("#content h2").first.inner_text()
        assert "(completed)" in page.locator(".breadcrumbs").inner_text()
        page.screenshot(path=SCREENSHOTS / f"run-live-finished-{name}.png", full_page=False)

        # Dashboard: every chart drawn with the vendored Chart.js.
        page.goto("/admin/dashboard/")
        page.wait_for_selector("#yx-dashboard[data-charts-drawn='9']", timeout=15_000)
        painted = page.evaluate(
            """() => Array.from(document.querySelectorAll('canvas')).map(c => {
                 const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                 let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; })"""
        )
        assert len(painted) == 9 and all(n > 0 for n in painted), painted
        # Cost by model and day and by user are charts too (R-COST-2).
        assert page.locator("#chart-cost[data-drawn='1']").count() == 1
        # Each model has its own colour, the same in the token and the cost
        # chart, and the palette never repeats (issue 37).
        colours = page.evaluate(
            """() => ['chart-tokens', 'chart-cost'].map(id => Object.fromEntries(
                 Chart.getChart(document.getElementById(id)).data.datasets.map(d => [d.label, d.backgroundColor])))"""
        )
        tokens, cost = colours
        assert len(tokens) >= 2 and len(set(tokens.values())) == len(tokens), tokens
        assert all(cost[model] == tokens[model] for model in cost if model in tokens), colours
        assert page.evaluate("() => new Set([...Array(60).keys()].map(yxPalette.colour)).size") == 60
        assert page.locator("[data-figure='cost']").count() == 1
        # The world's 3 ordinary messages; its 7 audit rows and the big runs'
        # audit rows are not messages (R-READ-4).
        assert page.locator("[data-figure='messages'] .yx-value").inner_text().strip() == "3"
        assert page.locator("#yx-feedback tbody tr").count() == 2
        page.screenshot(path=SCREENSHOTS / f"dashboard-{name}.png", full_page=True)
        assert errors == []
    finally:
        context.close()


# Collects every Content Security Policy violation of a page (R-SEC-1).
_CSP_WATCH = """
window.__cspViolations = [];
document.addEventListener('securitypolicyviolation', e =>
    window.__cspViolations.push(e.violatedDirective + ' ' + (e.blockedURI || 'inline')));
"""


def test_no_page_breaks_its_content_security_policy_R_SEC_1(web_url, admin_world, browser):
    """Each page the product serves, with its scripts running (the timeline
    expands, the live refresh, the dashboard draws its charts, Swagger UI
    renders the API), under the policy every response carries: nothing is
    blocked."""
    staff, run, _resume, live = admin_world
    context = browser.new_context(viewport={"width": 1280, "height": 900}, base_url=web_url)
    context.add_init_script(_CSP_WATCH)
    page = context.new_page()
    reported: list[str] = []
    page.on("console", lambda message: "Content Security Policy" in message.text and reported.append(message.text))

    def violations(url: str) -> list[str]:
        return [f"{url}: {v}" for v in page.evaluate("window.__cspViolations")]

    found: list[str] = []
    try:
        response = page.goto("/admin/login/?next=/admin/")
        assert "script-src 'self'" in response.headers["content-security-policy"]
        found += violations("login")
        page.fill("#id_username", staff.username)
        page.fill("#id_password", PASSWORD)
        page.click("input[type=submit]")
        page.wait_for_url("**/admin/")
        found += violations("index")
        page.goto(f"/admin/audit/agentrun/{run.pk}/change/")
        page.locator("#yx-timeline tr.yx-detail summary").first.click()
        found += violations("run")
        page.goto(f"/admin/audit/agentrun/{live.pk}/change/")
        assert page.locator(".yx-live").is_visible()
        found += violations("live run")
        page.goto(f"/admin/conversations/conversation/{run.thread_id}/timeline/")
        found += violations("thread timeline")
        page.goto("/admin/dashboard/")
        page.wait_for_selector("#yx-dashboard[data-charts-drawn='9']", timeout=15_000)
        found += violations("dashboard")
        page.goto("/api/docs")
        page.wait_for_selector(".swagger-ui .info", timeout=15_000)
        found += violations("api docs")
        # The watch itself works: an inline script is blocked and reported.
        assert reported == [], reported
        page.evaluate("document.body.appendChild(document.createElement('script')).textContent = 'window.ran = 1'")
        page.wait_for_function("window.__cspViolations.length > 0", timeout=15_000)
        assert page.evaluate("window.ran") is None
    finally:
        context.close()
    assert found == [], found


def _sign_in(page, staff) -> None:
    page.goto("/admin/login/?next=/admin/")
    page.fill("#id_username", staff.username)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url("**/admin/")


@pytest.mark.parametrize(
    "viewport", [{"width": 1280, "height": 900}, {"width": 390, "height": 844}], ids=["1280", "390"]
)
def test_big_payload_loads_on_expand_and_a_thread_is_grouped_by_run_R_ADM_1(
    web_url, django_user_model, user, browser, viewport
):
    """Issue 37: the run page's timeline starts above the fold; a
    1,000,000-character tool result loads whole when its row is expanded
    (a static script, under the CSP); a thread's timeline is one group per
    run, the newest three open."""
    staff = django_user_model.objects.create_user(
        username="browser-staff", password=PASSWORD, is_staff=True, is_superuser=True
    )
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:tool_then_answer")
    first = timezone.now() - dt.timedelta(days=1)
    for k in range(5):
        big_run(thread, rows=6, start=first + dt.timedelta(hours=k))
    run, (row,) = big_result_run(thread)
    name = str(viewport["width"])
    context = browser.new_context(viewport=viewport, base_url=web_url)
    context.add_init_script(_CSP_WATCH)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        _sign_in(page, staff)

        page.goto(f"/admin/audit/agentrun/{run.pk}/change/")
        assert page.locator("#yx-timeline-title").bounding_box()["y"] < viewport["height"] / 2
        details = page.locator(f"#yx-timeline tr.yx-detail[data-id='{row.pk}']")
        content = details.locator("pre.yx-pre").first
        assert content.evaluate("e => e.textContent.length") == 2000
        details.locator("summary").click()
        page.wait_for_function(
            "id => document.querySelector(`tr.yx-detail[data-id='${id}'] .yx-cut`).textContent.startsWith('whole')",
            arg=str(row.pk),
            timeout=15_000,
        )
        assert content.evaluate("e => e.textContent.length") == BIG_RESULT
        assert content.evaluate("e => e.textContent.endsWith('THE END')")
        assert details.locator(".yx-cut").first.inner_text() == "whole text: 1,000,000 characters"
        page.screenshot(path=SCREENSHOTS / f"run-big-payload-{name}.png", full_page=False)

        page.goto(f"/admin/conversations/conversation/{thread.pk}/timeline/")
        groups = page.locator("#yx-timeline details.yx-run-group")
        assert groups.count() == 6
        assert page.locator("#yx-timeline details.yx-run-group[open]").count() == 3
        assert groups.last.locator("tr.yx-row").first.is_visible()
        # A collapsed run carries no rows; opening it loads them.
        assert groups.first.locator("tr.yx-row").count() == 0
        groups.first.locator(":scope > summary").click()
        groups.first.locator("tr.yx-row").first.wait_for(state="visible", timeout=15_000)
        assert groups.first.locator("tr.yx-row").count() == 6
        assert groups.first.locator(".yx-bar").count() == 6
        page.screenshot(path=SCREENSHOTS / f"thread-timeline-{name}.png", full_page=True)
        assert page.evaluate("window.__cspViolations") == []
        assert errors == []
    finally:
        context.close()


def _hint(page, selector: str) -> dict:
    """Whether the first box matching ``selector`` overflows, and the
    hint its ``::before`` shows (``none`` when there is none)."""
    return page.evaluate(
        """(selector) => { const box = document.querySelector(selector);
             const before = getComputedStyle(box, '::before');
             return {overflows: box.scrollWidth > box.clientWidth + 1, marked: box.hasAttribute('data-yx-overflows'),
                     hint: before.content, shown: before.display !== 'none' && before.content !== 'none',
                     scrolls: getComputedStyle(box).overflowX};
           }""",
        selector,
    )


@pytest.mark.parametrize("width", [390, 1280])
def test_wide_tables_scroll_in_their_box_with_a_hint_on_a_phone_issue_37(web_url, admin_world, browser, width):
    """At 390 px the run list, the message list and the run's timeline are
    wider than the screen: each scrolls sideways in its own box and shows a
    hint that stays visible while it scrolls. At 1280 px the run list fits:
    no scrolling, no hint."""
    staff, run, _resume, _live = admin_world
    context = browser.new_context(viewport={"width": width, "height": 900}, base_url=web_url)
    page = context.new_page()
    try:
        _sign_in(page, staff)
        for label, path, selector in (
            ("runs", "/admin/audit/agentrun/", "#changelist-form .results"),
            ("messages", "/admin/conversations/message/", "#changelist-form .results"),
            ("run-timeline", f"/admin/audit/agentrun/{run.pk}/change/", ".yx-scroll"),
        ):
            page.goto(path)
            page.wait_for_load_state("load")
            page.wait_for_timeout(100)  # scroll.js marks the boxes on the next frame
            found = _hint(page, selector)
            assert found["scrolls"] == "auto", (path, found)
            if width == 390:
                assert found["overflows"] and found["marked"] and found["shown"], (path, found)
                assert "Scroll sideways" in found["hint"], (path, found)
                # The page itself never scrolls sideways: only the box does.
                assert page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth"), path
                page.evaluate("(s) => document.querySelector(s).scrollIntoView({block: 'start'})", selector)
                page.screenshot(path=SCREENSHOTS / f"scroll-hint-{label}-390.png")
            elif label == "runs":
                assert not found["overflows"] and not found["marked"] and not found["shown"], (path, found)
        if width == 1280:
            page.goto("/admin/audit/agentrun/")
            assert _no_horizontal_scroll(page)
    finally:
        context.close()


# Model names as providers spell them, and one longer than a list shows.
MODEL_NAMES = [
    "replay:tool_then_answer",
    "openai:gpt-4o-mini-2024-07-18",
    "anthropic:claude-3-5-sonnet-20241022",
    "acme:a-model-name-with-a-piece-far-too-long_for_any_list_column",
]


@pytest.mark.parametrize("width", [1280, 390])
def test_run_list_model_names_wrap_only_between_their_parts_issue_37(web_url, admin_world, browser, width):
    """At 1280 px (beside the filters) and at 390 px, each model name on the
    run list wraps only after ":", "-" or "/": no piece of a name is broken
    over two lines or squeezed; a piece too long is cut with "…" and the
    whole name is the title. At 1280 px the list still fits."""
    staff, run, _resume, _live = admin_world
    for model in MODEL_NAMES:
        AgentRun.objects.create(
            request_id=f"browser-model-{model}",
            thread=run.thread,
            user=run.user,
            agent_id="assistant",
            model=model,
            status=AgentRun.Status.COMPLETED,
        )
    context = browser.new_context(viewport={"width": width, "height": 900}, base_url=web_url)
    page = context.new_page()
    try:
        _sign_in(page, staff)
        page.goto("/admin/audit/agentrun/")
        page.wait_for_load_state("load")
        cells = page.evaluate(
            """() => [...document.querySelectorAll('#result_list td.field-model_display .yx-model')].map(span => {
                 const pieces = [...span.childNodes].filter(n => n.nodeType === Node.TEXT_NODE).map(node => {
                   const range = document.createRange();
                   range.selectNodeContents(node);
                   const lines = new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)));
                   return {text: node.textContent, lines: lines.size};
                 });
                 const range = document.createRange();
                 range.selectNodeContents(span);
                 const lines = new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)));
                 return {title: span.title, pieces, lines: lines.size};
               })"""
        )
        by_title = {cell["title"]: cell for cell in cells}
        assert set(MODEL_NAMES) <= set(by_title), by_title.keys()
        for name in MODEL_NAMES:
            cell = by_title[name]
            # Every piece on one line: a name breaks only between pieces.
            assert all(piece["lines"] == 1 for piece in cell["pieces"]), (width, cell)
            shown = "".join(piece["text"] for piece in cell["pieces"])
            assert shown == name or (shown.endswith("…") and len(shown) < len(name)), (width, shown)
        # A short name takes one or two lines, not a letter a line.
        assert by_title["replay:tool_then_answer"]["lines"] <= 2, by_title["replay:tool_then_answer"]
        # At 390 px the list scrolls in its box: show the model column.
        page.evaluate("() => document.querySelector('td.field-model_display').scrollIntoView({inline: 'center'})")
        page.screenshot(path=SCREENSHOTS / f"runs-models-{width}.png")
        if width == 1280:
            assert _no_horizontal_scroll(page), "run list"
    finally:
        context.close()
