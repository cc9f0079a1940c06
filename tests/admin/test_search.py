"""Finding runs (R-ADM-2): every filter on the staff API and in the admin
run list gives the same runs; ids, request ids, tool call ids and words of
the audit find a run; the full-text search is indexed and never breaks an
audit write; paging is keyset; bad input is a 422 that changes nothing."""

from __future__ import annotations

import datetime as dt
import json
import random
import re
import uuid
from dataclasses import dataclass

import pytest
from django.db import connection
from django.urls import reverse

from audit.models import AgentRun
from conversations.models import Conversation, Message
from core.cursors import encode_cursor
from tests.conftest import bearer

pytestmark = pytest.mark.django_db

# An hour ago, whole seconds: running runs started in the past.
NOW = dt.datetime.now(dt.UTC).replace(microsecond=0) - dt.timedelta(hours=1)


def iso(moment: dt.datetime, *, naive: bool = False) -> str:
    return (moment.replace(tzinfo=None) if naive else moment).isoformat()


def make_run(
    thread,
    *,
    status: str = "completed",
    error_type: str = "",
    model: str | None = None,
    agent_id: str = "assistant",
    created: dt.datetime = NOW,
    seconds: float | None = 2.0,
    rows: list[dict] = (),
) -> AgentRun:
    """A run with the given audit rows (``{kind, status, tool, content,
    op}``), written with the ORM: the readers are under test here."""
    run = AgentRun.objects.create(
        request_id=f"req-{uuid.uuid4().hex[:12]}",
        thread=thread,
        user=thread.user,
        agent_id=agent_id,
        model=model or thread.model,
        status=status,
        error_type=error_type,
        started_at=created,
        finished_at=created + dt.timedelta(seconds=seconds) if seconds is not None else None,
        usage={"input_tokens": 1, "output_tokens": 1, "total_tokens": 2, "unknown_calls": 0},
    )
    AgentRun.objects.filter(pk=run.pk).update(created_at=created)
    for i, row in enumerate(rows, start=1):
        is_tool = row.get("kind") == "tool"
        Message.objects.create(
            thread=thread,
            run=run,
            role=Message.Role.TOOL if is_tool else Message.Role.ASSISTANT,
            message_type=Message.Type.TOOL_AUDIT if is_tool else Message.Type.MODEL_AUDIT,
            operation_id=row.get("op") or f"op-{uuid.uuid4().hex[:10]}",
            sequence=i,
            execution_status=row.get("status", "completed"),
            started_at=None if row.get("status") == "rejected" else created,
            finished_at=created,
            tool_name=row.get("tool", "") if is_tool else "",
            tool_input=row.get("input"),
            content=row.get("content", ""),
        )
    run.refresh_from_db()
    return run


@dataclass
class World:
    paris: AgentRun
    email_failed: AgentRun
    email_rejected: AgentRun
    slow: AgentRun
    other_model: AgentRun
    old: AgentRun
    running: AgentRun
    other_user_run: AgentRun

    def all(self) -> set[str]:
        return {str(r.pk) for r in vars(self).values()}


@pytest.fixture
def world(user, other_user) -> World:
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:tool_then_answer")
    other = Conversation.objects.create(user=other_user, agent_id="assistant", model="replay:plain_answer")
    return World(
        paris=make_run(
            thread,
            created=NOW - dt.timedelta(minutes=1),
            rows=[
                {"kind": "model", "content": "Let me check the weather in Paris."},
                {"kind": "tool", "tool": "get_weather", "op": "call_paris_1", "content": "sunny, 21 degrees"},
                {"kind": "model", "content": "巴黎 今天 晴天"},
            ],
        ),
        email_failed=make_run(
            thread,
            status="failed",
            error_type="tool_error",
            created=NOW - dt.timedelta(minutes=2),
            rows=[{"kind": "tool", "tool": "send_email", "status": "failed", "content": "smtp relay refused"}],
        ),
        email_rejected=make_run(
            thread,
            created=NOW - dt.timedelta(minutes=3),
            rows=[{"kind": "tool", "tool": "send_email", "status": "rejected", "content": "User rejected the call"}],
        ),
        slow=make_run(thread, created=NOW - dt.timedelta(minutes=4), seconds=90),
        other_model=make_run(
            thread,
            status="failed",
            error_type="model_error",
            model="replay:plain_answer",
            created=NOW - dt.timedelta(minutes=5),
            rows=[{"kind": "tool", "tool": "get_weather", "status": "failed", "content": "unknown city Atlantis"}],
        ),
        old=make_run(thread, created=NOW - dt.timedelta(days=10)),
        running=make_run(thread, status="running", created=NOW - dt.timedelta(minutes=6), seconds=None),
        other_user_run=make_run(other, created=NOW - dt.timedelta(minutes=7)),
    )


def api_ids(client, headers, **params) -> set[str]:
    response = client.get("/api/audit/runs", params | {"limit": 200}, headers=headers)
    assert response.status_code == 200, response.content
    return {item["run_id"] for item in response.json()["items"]}


def admin_ids(client, **params) -> set[str]:
    response = client.get(reverse("admin:audit_agentrun_changelist"), params)
    assert response.status_code == 200
    html = response.content.decode()
    assert 'class="errornote"' not in html and "errorlist" not in html, html[:2000]
    shown = set(re.findall(r'<th class="field-short_id"><a href="/admin/audit/agentrun/([0-9a-f-]{36})/change/', html))
    return shown


FILTER_CASES = [
    ({"status": "failed"}, ["email_failed", "other_model"]),
    ({"status": "failed,running"}, ["email_failed", "other_model", "running"]),
    ({"error_type": "model_error"}, ["other_model"]),
    ({"model": "replay:plain_answer"}, ["other_model", "other_user_run"]),
    ({"agent": "assistant"}, None),  # every run
    ({"tool": "send_email"}, ["email_failed", "email_rejected"]),
    ({"tool": "send_email", "tool_status": "failed"}, ["email_failed"]),
    ({"tool_status": "failed"}, ["email_failed", "other_model"]),
    ({"tool": "get_weather", "tool_status": "rejected"}, []),  # the same row must have both
    ({"rejected": "true"}, ["email_rejected"]),
    ({"min_duration_ms": "60000"}, ["slow", "running"]),  # a running run counts up to now
    # A naive time is UTC; ``to`` is exclusive.
    (
        {"from": iso(NOW - dt.timedelta(minutes=4), naive=True), "to": iso(NOW - dt.timedelta(minutes=1))},
        ["email_failed", "email_rejected", "slow"],
    ),
    ({"from": (NOW - dt.timedelta(days=1)).date().isoformat()}, None),  # a date is midnight UTC: all but the old run
    # from = to: an empty window, no run (not refused: found by schemathesis).
    ({"from": iso(NOW - dt.timedelta(minutes=4)), "to": iso(NOW - dt.timedelta(minutes=4))}, []),
    ({"q": "Paris"}, ["paris"]),
    ({"q": "sunny degrees"}, ["paris"]),  # every word, in one row (message or audit row)
    ({"q": "paris sunny"}, []),  # words of two different rows
    ({"q": '"smtp relay"'}, ["email_failed"]),
    ({"q": "smtp -relay"}, []),
    ({"q": "晴天"}, ["paris"]),  # the simple configuration: any language with separated words
    ({"q": "call_paris_1"}, ["paris"]),  # a tool call id
    ({"q": "Atlantis", "status": "failed"}, ["other_model"]),
]


def _expected(world: World, names, params) -> set[str]:
    if names is not None:
        return {str(getattr(world, n).pk) for n in names}
    if params.get("from") == (NOW - dt.timedelta(days=1)).date().isoformat():
        return world.all() - {str(world.old.pk)}
    return world.all()


@pytest.mark.parametrize(("params", "names"), FILTER_CASES, ids=[str(p) for p, _ in FILTER_CASES])
def test_each_filter_finds_the_same_runs_in_the_api_and_the_admin_R_ADM_2(
    client, staff_user, world, params, names, monkeypatch
):
    expected = _expected(world, names, params)
    assert api_ids(client, bearer(staff_user), **params) == expected
    client.force_login(staff_user)
    assert admin_ids(client, **params) == expected


def test_tool_and_tool_status_match_one_tool_row_in_the_admin_as_in_the_api_R_ADM_2(client, staff_user, world):
    """A run whose get_weather call completed and whose send_email call
    failed has no failed get_weather call: the admin applied the two
    filters apart (two EXISTS, slower and wrong) where the API asks for one
    tool row with both."""
    mixed = make_run(
        world.paris.thread,
        created=NOW - dt.timedelta(minutes=8),
        rows=[{"kind": "tool", "tool": "get_weather"}, {"kind": "tool", "tool": "send_email", "status": "failed"}],
    )
    params = {"tool": "get_weather", "tool_status": "failed"}
    assert api_ids(client, bearer(staff_user), **params) == {str(world.other_model.pk)}
    client.force_login(staff_user)
    assert admin_ids(client, **params) == {str(world.other_model.pk)}
    # Each alone still finds the mixed run.
    assert str(mixed.pk) in admin_ids(client, tool="get_weather")
    assert str(mixed.pk) in admin_ids(client, tool_status="failed")
    # A bad status next to a tool is named, and shows no runs.
    html = client.get(reverse("admin:audit_agentrun_changelist"), {"tool": "get_weather", "tool_status": "x"})
    assert "Tool status: Input should be" in html.content.decode()
    assert "field-short_id" not in html.content.decode()


def test_user_filter_takes_a_username_or_an_id_R_ADM_2(client, staff_user, world, other_user):
    headers = bearer(staff_user)
    assert api_ids(client, headers, user=other_user.username) == {str(world.other_user_run.pk)}
    assert api_ids(client, headers, user=str(other_user.pk)) == {str(world.other_user_run.pk)}
    assert api_ids(client, headers, user="nobody-by-that-name") == set()
    client.force_login(staff_user)
    assert admin_ids(client, user=other_user.username) == {str(world.other_user_run.pk)}


def test_ids_and_their_prefixes_find_a_run_R_ADM_2(client, staff_user, world):
    headers = bearer(staff_user)
    run = world.email_failed
    for term in (str(run.pk), str(run.pk)[:8], str(run.pk).upper(), run.request_id):
        assert api_ids(client, headers, q=term) == {str(run.pk)}, term
    # A thread id (or its first 8 hex digits) finds the thread's runs.
    thread_runs = {str(r.pk) for r in AgentRun.objects.filter(thread=run.thread)}
    assert api_ids(client, headers, q=str(run.thread_id)[:8]) == thread_runs
    # Turn id too.
    assert api_ids(client, headers, q=str(run.turn_id)) == {str(run.pk)}
    # Fewer than 8 hex digits is no id: no prefix scan, words only.
    assert str(run.pk) not in api_ids(client, headers, q=str(run.pk)[:6])
    client.force_login(staff_user)
    assert admin_ids(client, q=str(run.pk)[:8]) == {str(run.pk)}


def test_message_list_searches_words_ids_and_operation_ids_R_ADM_2(client, staff_user, world):
    client.force_login(staff_user)
    url = reverse("admin:conversations_message_changelist")
    refused = Message.objects.get(content="smtp relay refused")
    for term in ("smtp", '"relay refused"', str(world.email_failed.pk)[:8]):
        html = client.get(url, {"q": term}).content.decode()
        assert f"/admin/conversations/message/{refused.pk}/change/" in html, term
    html = client.get(url, {"q": "call_paris_1"}).content.decode()
    assert re.findall(r"/admin/conversations/message/(\d+)/change/", html)[0] == str(
        Message.objects.get(operation_id="call_paris_1").pk
    )


def _search_plan(words: str) -> str:
    """PostgreSQL's plan of a words search, with sequential scans off (tiny
    tables would make the planner prefer them)."""
    from audit.reads.search import MatchesWords

    query = Message.objects.filter(MatchesWords(words)).values("run_id")
    sql, params = query.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute("EXPLAIN " + sql, params)
        return "\n".join(row[0] for row in cursor.fetchall())


def test_words_search_is_answered_by_the_gin_index_R_ADM_2(world):
    """The query's expression is the indexed generated column: PostgreSQL
    answers it from ``message_search_idx``."""
    plan = _search_plan("paris")
    assert "message_search_idx" in plan, plan


def test_huge_content_and_input_never_break_an_audit_write_R_ADM_2_R_MA_1(thread):
    """The generated vector is cut to bounded parts: a row far beyond
    PostgreSQL's 1 MB tsvector limit is written, its first words found."""
    run = make_run(thread)
    distinct_words = " ".join(f"w{i}x{uuid.uuid4().hex}" for i in range(60_000))  # ~2.5 MB, all distinct
    row = Message.objects.create(
        thread=thread,
        run=run,
        role=Message.Role.TOOL,
        message_type=Message.Type.TOOL_AUDIT,
        operation_id="call_huge",
        content="needle-start " + distinct_words,
        tool_name="lookup_docs",
        tool_input={"query": distinct_words},
        tool_calls=None,
    )
    row.content += " more"
    row.save(update_fields=["content"])
    from audit.reads.search import MatchesWords

    assert Message.objects.filter(MatchesWords("needle-start"), pk=row.pk).exists()


def test_run_list_pages_by_keyset_newest_first_R_ADM_2(client, staff_user, world):
    headers = bearer(staff_user)
    seen: list[str] = []
    before = None
    pages = 0
    while True:
        params = {"limit": 3} | ({"before": before} if before else {})
        body = client.get("/api/audit/runs", params, headers=headers).json()
        seen += [item["run_id"] for item in body["items"]]
        pages += 1
        if not body["has_more"]:
            assert body["next_before"] is None
            break
        before = body["next_before"]
    assert pages == 3 and len(seen) == len(set(seen)) == 8
    created = [AgentRun.objects.get(pk=run_id).created_at for run_id in seen]
    assert created == sorted(created, reverse=True)
    first = client.get("/api/audit/runs", {"limit": 1}, headers=headers).json()["items"][0]
    assert first["run_id"] == str(world.paris.pk)
    assert first["model_calls"] == 2 and first["tool_executions"] == 1
    assert first["duration_ms"] == 2000 and first["user"] == world.paris.user.username


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"status": "bogus"}, "status"),
        ({"status": ""}, None),  # blank: no filter, as the schema's pattern allows
        ({"status": "failed,"}, "status"),  # an empty status, which the pattern refuses
        ({"status": " failed"}, "status"),
        ({"tool_status": "exploded"}, "tool_status"),
        ({"min_duration_ms": "-1"}, "min_duration_ms"),
        ({"min_duration_ms": "9" * 30}, "min_duration_ms"),
        ({"from": "yesterday"}, "from"),
        ({"from": "2026-11-30T12:00:00Z", "to": "2026-11-30T11:00:00Z"}, "from"),  # after "to"
        ({"rejected": "perhaps"}, "rejected"),
        ({"limit": "0"}, "limit"),
        ({"limit": "201"}, "limit"),
        ({"before": "not-a-cursor"}, "cursor"),
        ({"q": "x" * 501}, "q"),
        ({"min_cost_usd": "1.5"}, "min_cost_usd"),
    ],
)
def test_bad_filters_answer_422_and_change_nothing_R_ADM_2_R_READ_6(client, staff_user, world, params, field):
    before = AgentRun.objects.count(), Message.objects.count()
    response = client.get("/api/audit/runs", params, headers=bearer(staff_user))
    if field is None:
        assert response.status_code == 200
        return
    if field == "min_cost_usd" and "cost_usd" in {f.name for f in Message._meta.get_fields()}:
        assert response.status_code == 200  # cost recorded on this installation
        return
    assert response.status_code == 422, response.content
    error = response.json()["error"]
    assert error["code"] == "invalid_input"
    assert field in str(error), error
    assert (AgentRun.objects.count(), Message.objects.count()) == before


def test_bad_filter_in_the_admin_shows_an_error_and_no_runs_R_ADM_2(client, staff_user, world):
    client.force_login(staff_user)
    response = client.get(reverse("admin:audit_agentrun_changelist"), {"min_duration_ms": "soon"})
    html = response.content.decode()
    assert response.status_code == 200 and "duration at least (ms)" in html
    assert "field-short_id" not in html


def test_run_list_is_for_staff_R_READ_5(client, user, world):
    assert client.get("/api/audit/runs").status_code == 401
    response = client.get("/api/audit/runs", headers=bearer(user))
    assert response.status_code == 403 and response.json()["error"]["code"] == "permission_denied"


def test_run_list_queries_do_not_grow_with_runs_R_ADM_2(
    client, staff_user, world, django_assert_max_num_queries, thread
):
    for _ in range(30):
        make_run(thread, rows=[{"kind": "tool", "tool": "get_weather"}, {"kind": "model", "content": "Paris"}])
    headers = bearer(staff_user)
    client.get("/api/audit/runs", headers=headers)  # the token's first use writes last_used_at
    for params in ({}, {"q": "Paris", "tool": "get_weather", "status": "completed"}, {"rejected": "false"}):
        # token lookup, one page query
        with django_assert_max_num_queries(2):
            body = client.get("/api/audit/runs", params | {"limit": 50}, headers=headers).json()
        assert body["items"], params
    client.force_login(staff_user)
    for params in ({}, {"q": "Paris", "tool": "get_weather"}, {"q": str(thread.pk)[:8]}, {"from": "2026-01-01"}):
        with django_assert_max_num_queries(8):
            assert client.get(reverse("admin:audit_agentrun_changelist"), params).status_code == 200


# -- words of every frequency on the run list (R-ADM-2) ------------------------


@pytest.fixture
def weather_log(user):
    """6,200 runs of one thread (created in pairs: ties broken by id), one
    model and one tool row each; every 7th run failed. Words:

    * ``drizzle``: both rows of two runs in three (~8,300 rows: a common word,
      found by walking the newest runs);
    * ``"drizzle again"``: the tool row of those runs (a phrase, ~4,100 rows);
    * ``hail``: both rows of the 1,100 oldest runs (2,200 rows: more than a
      few, but none in the walk's window of newest runs: the walk comes up
      short and the search gathers);
    * ``sleet``: five runs (rare: gathered at once);
    * a recent run's request id is ``hail`` (an id match joins the words').
    """
    from audit.reads.search import SEARCH_FEW_ROWS, SEARCH_WALK_RUNS

    total, old = 6_200, 1_100
    assert total - old >= SEARCH_WALK_RUNS and 2 * old > SEARCH_FEW_ROWS
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:tool_then_answer")
    # Bulk SQL: 18,600 rows through the ORM take a quarter of a minute.
    # Run n is the n-th newest (n // 2 seconds old: pairs tie on created_at).
    with connection.cursor() as cursor:
        cursor.execute(
            """INSERT INTO audit_agentrun (id, request_id, request_fingerprint, turn_id, agent_id, model, input,
                   status, fencing_token, error_type, error_message, usage, trace_id, created_at, started_at,
                   finished_at, updated_at, thread_id, user_id)
               SELECT md5(%(thread)s || n)::uuid, CASE WHEN n = 10 THEN 'hail' ELSE 'bulk-' || n END, '',
                   md5('turn' || %(thread)s || n)::uuid, 'assistant', 'replay:tool_then_answer', '{}',
                   CASE WHEN n %% 7 = 3 THEN 'failed' ELSE 'completed' END, 1,
                   CASE WHEN n %% 7 = 3 THEN 'model_error' ELSE '' END, '',
                   '{"input_tokens": 1, "output_tokens": 1, "total_tokens": 2, "unknown_calls": 0}', '',
                   %(now)s - (n / 2) * interval '1 second', %(now)s, %(now)s, %(now)s, %(thread)s, %(user)s
               FROM generate_series(0, %(total)s - 1) n""",
            {"thread": str(thread.pk), "now": NOW, "total": total, "user": user.pk},
        )
        cursor.execute(
            """INSERT INTO conversations_message (role, message_type, content, metadata, operation_id, started_at,
                   finished_at, sequence, execution_status, tool_name, created_at, updated_at, run_id, thread_id,
                   price_source, price_version)
               SELECT CASE WHEN tool THEN 'tool' ELSE 'assistant' END,
                   CASE WHEN tool THEN 'tool_audit' ELSE 'model_audit' END,
                   CASE WHEN n %% 3 = 1 THEN CASE WHEN tool THEN 'result ' ELSE 'turn ' END
                        WHEN tool THEN 'drizzle again ' ELSE 'light drizzle today ' END || n
                   || CASE WHEN n >= %(total)s - %(old)s THEN ' hail' ELSE '' END
                   || CASE WHEN tool AND n IN (5, 900, 2500, 4000, 5999) THEN ' sleet' ELSE '' END,
                   '{}', CASE WHEN tool THEN 't-' ELSE 'm-' END || n, %(now)s, %(now)s,
                   CASE WHEN tool THEN 2 ELSE 1 END, 'completed', CASE WHEN tool THEN 'get_weather' ELSE '' END,
                   %(now)s, %(now)s, md5(%(thread)s || n)::uuid, %(thread)s, '', ''
               FROM generate_series(0, %(total)s - 1) n CROSS JOIN (VALUES (false), (true)) kind(tool)""",
            {"thread": str(thread.pk), "now": NOW, "total": total, "old": old},
        )
        cursor.execute("ANALYZE audit_agentrun")
        cursor.execute("ANALYZE conversations_message")
    by_id = AgentRun.objects.in_bulk()
    runs = [by_id[uuid.UUID(_md5(f"{thread.pk}{n}"))] for n in range(total)]
    return runs


def _md5(text: str) -> str:
    import hashlib

    return hashlib.md5(text.encode()).hexdigest()


def _reference_page(filters, *, limit: int, before: str | None):
    """The page as the plain condition gives it: every matching run, then
    the newest ``limit`` (+1) after the cursor."""
    from audit.reads.search import _run_cursor, filter_runs

    runs = filter_runs(AgentRun.objects.all(), filters)
    if before is not None:
        created_at, run_id = _run_cursor(before)
        runs = runs.filter(created_at__lte=created_at).exclude(created_at=created_at, pk__gte=run_id)
    rows = list(runs.order_by("-created_at", "-pk").values_list("pk", flat=True)[: limit + 1])
    return rows[:limit], len(rows) > limit


def _walk_plan(filters, *, limit: int, before: str | None = None) -> dict[str, int]:
    """How many times each branch of the page's search ran (EXPLAIN
    ANALYZE of the page query): ``probe`` loops = runs walked,
    ``search_gathered`` loops = 1 when the GIN index gathered every match."""
    import json

    from django.test.utils import CaptureQueriesContext

    from audit.reads.search import run_list_page

    with CaptureQueriesContext(connection) as queries:
        run_list_page(filters, limit=limit, before=before)
    (sql,) = [q["sql"] for q in queries.captured_queries]
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)
        plan = cursor.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan
    loops: dict[str, int] = {}

    def visit(node):
        if node.get("Alias") in ("probe", "search_gathered"):
            loops[node["Alias"]] = loops.get(node["Alias"], 0) + node["Actual Loops"]
        for child in node.get("Plans", []):
            visit(child)

    visit(plan[0]["Plan"])
    return loops


WORD_CASES = [
    {"q": "drizzle"},
    {"q": '"drizzle again"'},
    {"q": "drizzle -today"},
    {"q": "hail"},
    {"q": "sleet"},
    {"q": "drizzle or sleet"},
    {"q": "drizzle", "status": "failed"},
    {"q": "hail", "status": "failed"},
    {"q": "drizzle", "tool": "get_weather", "min_duration_ms": 0},
]


def test_run_list_pages_of_a_word_match_the_plain_search_R_ADM_2(weather_log):
    """Whatever the word's frequency and the plan it takes, the run list
    gives exactly the pages the plain condition gives: the same runs, in
    order, across cursors (also from one deep in the list, where fewer runs
    than the walk's window remain). One test: the log takes seconds to load."""
    from audit.reads.search import filters_from, run_list_page

    deep = AgentRun.objects.get(pk=weather_log[5_500].pk)
    for params in WORD_CASES:
        filters = filters_from(params)
        for start in (None, encode_cursor([deep.created_at.isoformat(), str(deep.pk)])):
            before = start
            for _ in range(3):
                page = run_list_page(filters, limit=50, before=before)
                expected, more = _reference_page(filters, limit=50, before=before)
                assert [run.pk for run in page.items] == expected, (params, before)
                assert page.has_more == more, (params, before)
                if not page.has_more:
                    break
                before = page.next_before


def test_a_common_word_walks_the_newest_runs_a_rare_one_is_gathered_R_ADM_2(weather_log):
    """The plan each word takes (decided by the data, not by the planner's
    estimate): a word two runs in three hold is found by probing the newest
    runs until the page is full, never by gathering its ~8,300 rows; a rare
    word is gathered from the GIN index without walking; a word many rows
    hold but no recent run walks the window, then gathers."""
    from audit.reads.search import SEARCH_WALK_RUNS, filters_from

    common = _walk_plan(filters_from({"q": "drizzle"}), limit=50)
    assert common.get("search_gathered", 0) == 0, common
    assert 0 < common.get("probe", 0) <= 100, common  # 51 matches among the newest ~77 runs
    rare = _walk_plan(filters_from({"q": "sleet"}), limit=50)
    assert rare.get("probe", 0) == 0 and rare["search_gathered"] == 1, rare
    old = _walk_plan(filters_from({"q": "hail"}), limit=50)
    assert old["probe"] == SEARCH_WALK_RUNS and old["search_gathered"] == 1, old


def test_the_admin_run_list_walks_a_common_word_and_says_at_least_R_ADM_2(client, staff_user, weather_log):
    """The admin run list in its own order finds a word many rows hold the
    way the API does — the newest runs probed until the page is full — so
    its pages are the plain search's pages and its count says "at least";
    sorted by a column, or for a rare word, it gathers every match and
    counts them exactly."""
    from django.test.utils import CaptureQueriesContext

    from audit.reads.search import filters_from

    client.force_login(staff_user)
    url = reverse("admin:audit_agentrun_changelist")
    expected, _ = _reference_page(filters_from({"q": "drizzle"}), limit=100, before=None)

    def page(**params):
        with CaptureQueriesContext(connection) as queries:
            response = client.get(url, params)
        assert response.status_code == 200
        html = response.content.decode()
        shown = re.findall(r'<th class="field-short_id"><a href="/admin/audit/agentrun/([0-9a-f-]{36})/change/', html)
        walked = any("search_walked" in q["sql"] for q in queries.captured_queries)
        return [uuid.UUID(pk) for pk in shown], html, walked

    first, html, walked = page(q="drizzle")
    assert walked and first == expected[:50]
    assert "51+ results" in html and "51+ agent runs" in html and "Select all matching agent runs" in html
    second, html, _ = page(q="drizzle", p=2)
    assert second == expected[50:100] and "101+ agent runs" in html

    # Sorted by a column: every match gathered, counted exactly.
    _, html, walked = page(q="sleet", o="-2")
    assert not walked and "5 results" in html and "+ results" not in html
    rare, html, _ = page(q="sleet")
    assert len(rare) == 5 and "5 results" in html and "+ results" not in html

    # "Select all" then an action takes every match of the search, not the
    # page the walk found.
    exported = client.post(
        f"{url}?q=drizzle",
        {"action": "export_jsonl", "select_across": "1", "_selected_action": [str(first[0])]},
    )
    assert exported.status_code == 200
    runs = {json.loads(line)["run_id"] for line in b"".join(exported.streaming_content).decode().splitlines() if line}
    assert len(runs) == sum(1 for n in range(len(weather_log)) if n % 3 != 1)


# --------------------------------------------------------------------------
# Chinese, Japanese and Korean phrases inside a sentence (R-ADM-3)
# --------------------------------------------------------------------------

CJK_SENTENCES = {
    "zh": "请使用深度检索工具",
    "ja": "深層検索ツールを使ってください",
    "ko": "오늘은 심층검색도구를 사용하세요",
    "mixed": "先用GPT4模型回答，再检查。",
}


@pytest.fixture
def cjk_runs(thread) -> dict[str, AgentRun]:
    runs = {
        lang: make_run(thread, created=NOW - dt.timedelta(minutes=i), rows=[{"kind": "model", "content": text}])
        for i, (lang, text) in enumerate(CJK_SENTENCES.items(), start=1)
    }
    runs["english"] = make_run(
        thread, created=NOW - dt.timedelta(minutes=9), rows=[{"kind": "model", "content": "deep search tool"}]
    )
    return runs


CJK_CASES = [
    ("深度检索", ["zh"]),  # R-ADM-3's example: inside 请使用深度检索工具
    ("使用深度检索工具", ["zh"]),
    ("请使用深度检索工具", ["zh"]),  # the whole run, as before
    ("检索工具 -深度检索", []),
    ("检索深度", []),  # the same characters in another order
    ("深检索度", []),
    ("検索ツール", ["ja"]),
    ("ツールを使", ["ja"]),
    ("ツール検索", []),
    ("검색도구", ["ko"]),
    ("도구검색", []),
    ('"오늘은 심층검색"', ["ko"]),  # a phrase across a space
    ("模型", ["mixed"]),  # set apart from the Latin letters next to it
    ("GPT4模型", ["mixed"]),
    ("gpt4", ["mixed"]),
    ("检查 or 검색도구", ["mixed", "ko"]),
    ("deep search", ["english"]),
]


@pytest.mark.parametrize(("q", "names"), CJK_CASES, ids=[q for q, _ in CJK_CASES])
def test_a_cjk_phrase_is_found_inside_a_sentence_in_its_order_R_ADM_3(client, staff_user, cjk_runs, q, names):
    expected = {str(cjk_runs[n].pk) for n in names}
    assert api_ids(client, bearer(staff_user), q=q) == expected
    client.force_login(staff_user)
    assert admin_ids(client, q=q) == expected


def test_the_message_list_finds_a_cjk_phrase_inside_a_sentence_R_ADM_3(client, staff_user, cjk_runs):
    client.force_login(staff_user)
    row = Message.objects.get(run=cjk_runs["zh"])
    url = reverse("admin:conversations_message_changelist")
    assert f"/admin/conversations/message/{row.pk}/change/" in client.get(url, {"q": "深度检索"}).content.decode()
    assert f"/admin/conversations/message/{row.pk}/change/" not in client.get(url, {"q": "检索深度"}).content.decode()


def test_a_cjk_phrase_is_answered_by_the_gin_index_R_ADM_3(cjk_runs):
    plan = _search_plan("深度检索")
    assert "message_search_idx" in plan, plan


def test_the_index_and_the_query_write_cjk_text_alike_R_ADM_3():
    """``search_text`` (Python, the query) and ``audit_search_text`` (SQL,
    the generated column) give the same text, character class included."""
    from audit.reads.search import search_text

    alphabet = "深度检索请使用工具ツールをひらがなー데이터베이스를々〇\U00020001ｱｲ a1-,。，"
    rng = random.Random(3)
    samples = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14))) for _ in range(300)]
    samples += [*CJK_SENTENCES.values(), "no CJK at all", ""]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT audit_search_text(s) FROM unnest(%s::text[]) WITH ORDINALITY AS t(s, n) ORDER BY n", [samples]
        )
        in_sql = [row[0] for row in cursor.fetchall()]
    assert in_sql == [search_text(s) for s in samples]
    assert search_text("请使用深度检索工具") == " 请使 使用 用深 深度 度检 检索 索工 工具 "
    assert search_text("the weather in Paris") == "the weather in Paris"


def test_huge_cjk_content_never_breaks_an_audit_write_R_ADM_3_R_MA_1(thread):
    """Bigrams triple a CJK text: a row of 60,000 distinct characters and
    as many in its tool input (worst case: every bigram distinct) is written
    under the 1 MB tsvector limit, its first phrase found."""
    rng = random.Random(5)
    han = [chr(c) for c in range(0x4E00, 0x9FFF)]
    text = "".join(rng.choice(han) for _ in range(60_000))
    run = make_run(thread)
    row = Message.objects.create(
        thread=thread,
        run=run,
        role=Message.Role.TOOL,
        message_type=Message.Type.TOOL_AUDIT,
        operation_id="call_huge_cjk",
        content=text,
        tool_name="lookup_docs",
        tool_input={"query": text},
        tool_calls=[{"id": "x", "name": "lookup_docs", "args": {"query": text}}],
    )
    from audit.reads.search import MatchesWords

    assert Message.objects.filter(MatchesWords(text[100:110]), pk=row.pk).exists()
