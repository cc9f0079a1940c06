"""Webhooks on run end (R-API-3): a submit or resume names a ``webhook``;
when the run ends the product POSTs the run's body, signed with
``WEBHOOK_SECRET`` (``X-Yuxi-Signature``), with a delivery id
(``X-Yuxi-Delivery``), queued from PostgreSQL behind a durable cursor and
retried until a real receiver (an HTTP server in this process) accepts it;
only to hosts of ``WEBHOOK_ALLOWED_HOSTS``."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import threading
import uuid
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.utils import timezone

from audit import ledger
from audit.execution.runner import run_execute
from audit.models import AgentRun
from conversations.models import Conversation
from core.errors import InvalidInput
from tests.conftest import bearer
from webhooks.body import run_body
from webhooks.models import WebhookAttempt, WebhookCursor, WebhookDelivery
from webhooks.services import deliveries_queue, deliveries_send, retry_delay, signature
from webhooks.targets import host_allowed, webhook_checked

from .receiver import WebhookReceiver

pytestmark = pytest.mark.django_db(transaction=True)

SECRET = "whsec-test-0123456789"


@pytest.fixture
def webhook_config(monkeypatch):
    """Webhooks on for loopback, no settle time (the tests' runs are
    committed before a pass), retries due at once, short timeouts."""
    from core.config import get_config

    config = get_config()
    monkeypatch.setattr(config, "WEBHOOK_ALLOWED_HOSTS", ["127.0.0.1"])
    monkeypatch.setattr(config, "WEBHOOK_SECRET", SECRET)
    monkeypatch.setattr(config, "WEBHOOK_SETTLE_SECONDS", 0.0)
    monkeypatch.setattr(config, "WEBHOOK_RETRY_BASE_SECONDS", 0.0)
    monkeypatch.setattr(config, "WEBHOOK_TIMEOUT_SECONDS", 1.0)
    monkeypatch.setattr(config, "WEBHOOK_MAX_ATTEMPTS", 20)
    return config


@pytest.fixture
def receiver():
    server = WebhookReceiver()
    yield server
    server.stop()


def submit(thread, text: str = "hello", **extra):
    body = {"request_id": uuid.uuid4().hex, "input": {"text": text}, **extra}
    return Client().post(
        f"/api/threads/{thread.id}/runs", json.dumps(body), content_type="application/json", headers=bearer(thread.user)
    )


def ended_run(user, scenario: str, webhook: str, text: str = "hello") -> AgentRun:
    """A run of ``scenario`` submitted over the API with ``webhook``, then
    executed in this process."""
    thread = Conversation.objects.create(user=user, agent_id="assistant", model=f"replay:{scenario}")
    response = submit(thread, text, webhook=webhook)
    assert response.status_code == 202, response.content
    run_id = response.json()["run_id"]
    run_execute(run_id=uuid.UUID(run_id), owner="in-process")
    return AgentRun.objects.get(pk=run_id)


def one_pass():
    return deliveries_queue(), deliveries_send(render=run_body)


def test_the_ended_run_is_posted_signed_with_its_delivery_id_once_R_API_3(
    user, replay_models, webhook_config, receiver
):
    run = ended_run(user, "tool_then_answer", receiver.url, "Weather in Paris?")
    assert run.status == "completed" and run.webhook == receiver.url

    queued, sent = one_pass()
    assert queued == 1 and sent.delivered == 1 and sent.attempts == 1
    [request] = receiver.received
    delivery = WebhookDelivery.objects.get()
    assert request.path == "/hooks/runs"
    assert request.headers["content-type"] == "application/json"
    assert request.headers["x-yuxi-delivery"] == str(delivery.id)
    # The receiver's check: HMAC-SHA256 of the raw body with the shared secret.
    expected = "sha256=" + hmac.new(SECRET.encode(), request.body, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(request.headers["x-yuxi-signature"], expected)
    assert signature(request.body, SECRET) == expected
    # The body is the run as GET /api/runs/{id} answers it.
    api_body = Client().get(f"/api/runs/{run.id}", headers=bearer(user)).json()
    assert json.loads(request.body) == api_body
    assert api_body["status"] == "completed" and api_body["output_message_id"] is not None

    assert delivery.status == "delivered" and delivery.attempts == 1 and delivery.run_status == "completed"
    [attempt] = WebhookAttempt.objects.filter(delivery=delivery)
    assert attempt.number == 1 and attempt.status_code == 200 and attempt.error == ""
    cursor = WebhookCursor.objects.get()
    assert (cursor.finished_at, cursor.run_id) == (run.finished_at, run.id)

    # Nothing twice: the cursor and the delivery's status hold.
    queued, sent = one_pass()
    assert queued == 0 and sent.attempts == 0 and len(receiver.received) == 1


def test_a_receiver_that_is_down_delays_and_loses_nothing_R_API_3(user, replay_models, webhook_config):
    down = WebhookReceiver()
    url, port = down.url, down.port
    down.stop()  # nothing listens on the port
    run = ended_run(user, "plain_answer", url)

    queued, sent = one_pass()
    assert queued == 1 and sent.retrying == 1 and sent.delivered == 0
    delivery = WebhookDelivery.objects.get()
    assert delivery.status == "pending" and delivery.attempts == 1 and delivery.last_status_code is None
    assert "ConnectionError" in delivery.last_error

    receiver = WebhookReceiver(port=port)  # back, but failing
    try:
        receiver.script = ["500"]
        assert deliveries_send(render=run_body).retrying == 1
        delivery.refresh_from_db()
        assert delivery.status == "pending" and delivery.last_status_code == 500 and delivery.last_error == "HTTP 500"

        sent = deliveries_send(render=run_body)
        assert sent.delivered == 1
        delivery.refresh_from_db()
        assert delivery.status == "delivered" and delivery.attempts == 3 and delivery.delivered_at is not None
        attempts = list(WebhookAttempt.objects.filter(delivery=delivery).values_list("number", "status_code"))
        assert attempts == [(1, None), (2, 500), (3, 200)]
        # Both requests it saw are the same delivery, with the same signed body.
        assert {r.headers["x-yuxi-delivery"] for r in receiver.received} == {str(delivery.id)}
        assert len({r.body for r in receiver.received}) == 1
        assert json.loads(receiver.received[-1].body)["run_id"] == str(run.id)
    finally:
        receiver.stop()


def test_a_failing_receiver_is_tried_once_a_pass_and_holds_no_other_back_R_API_3(user, replay_models, webhook_config):
    """Three deliveries to a receiver slower than the timeout and one to
    another: a pass tries the slow one once (one timeout, not three) and
    delivers the other; the next pass, the slow receiver fixed, delivers
    its three."""
    slow, other = WebhookReceiver(), WebhookReceiver()
    try:
        slow.default, slow.slow_seconds = "slow", 3 * webhook_config.WEBHOOK_TIMEOUT_SECONDS
        for _ in range(3):
            ended_run(user, "plain_answer", slow.url)
        ended_run(user, "plain_answer", other.url)
        queued, sent = one_pass()
        assert queued == 4 and sent.attempts == 2 and sent.delivered == 1 and sent.retrying == 1
        assert not sent.caught_up
        assert len(slow.received) == 1 and len(other.received) == 1
        attempts = sorted(
            WebhookDelivery.objects.filter(receiver=f"http://127.0.0.1:{slow.port}").values_list("attempts", flat=True)
        )
        assert attempts == [0, 0, 1]
        assert "Timeout" in WebhookAttempt.objects.get(delivery__receiver=f"http://127.0.0.1:{slow.port}").error

        slow.default = "ok"
        sent = deliveries_send(render=run_body)
        assert sent.delivered == 3 and sent.caught_up
        assert set(WebhookDelivery.objects.values_list("status", flat=True)) == {"delivered"}
    finally:
        slow.stop()
        other.stop()


def test_the_receiver_of_a_url_is_its_scheme_host_and_port_R_API_3():
    from webhooks.targets import receiver_of

    assert receiver_of("HTTP://Hooks.Example.com/a?b") == "http://hooks.example.com:80"
    assert receiver_of("https://hooks.example.com") == "https://hooks.example.com:443"
    assert receiver_of("https://hooks.example.com:8443/x") == "https://hooks.example.com:8443"
    assert receiver_of("") == receiver_of("http://") == receiver_of("http://[::1/x") == ""


def test_retries_back_off_and_give_up_after_the_last_attempt_R_API_3(user, replay_models, webhook_config, receiver):
    assert [retry_delay(n, base=5, cap=60) for n in (1, 2, 3, 4, 5, 9)] == [5, 10, 20, 40, 60, 60]
    webhook_config.WEBHOOK_MAX_ATTEMPTS = 2
    receiver.default = "302"  # a redirect is never followed
    ended_run(user, "plain_answer", receiver.url)
    queued, sent = one_pass()
    assert sent.retrying == 1
    assert deliveries_send(render=run_body).failed == 1
    delivery = WebhookDelivery.objects.get()
    assert delivery.status == "failed" and delivery.attempts == 2
    assert delivery.last_error == "HTTP 302 (redirects are not followed)"
    assert [r.path for r in receiver.received] == ["/hooks/runs", "/hooks/runs"]
    assert deliveries_send(render=run_body).attempts == 0  # given up: no more

    # With the default backoff the next attempt waits.
    webhook_config.WEBHOOK_RETRY_BASE_SECONDS = 60.0
    receiver.default = "500"
    ended_run(user, "plain_answer", receiver.url)
    deliveries_queue()
    assert deliveries_send(render=run_body).retrying == 1
    assert deliveries_send(render=run_body).attempts == 0


@pytest.mark.parametrize(
    "webhook",
    ["http://example.com/hook", "http://127.0.0.1.evil.example/hook", "HTTPS://0000/hook", "http://exa\u2100mple/"],
)
def test_a_webhook_outside_the_allowed_hosts_is_refused_and_creates_nothing_R_API_3(thread, webhook_config, webhook):
    response = submit(thread, webhook=webhook)
    assert response.status_code == 403, response.content
    error = response.json()["error"]
    assert error["code"] == "webhook_not_allowed" and error["reason"] == "host_not_allowed"
    assert not AgentRun.objects.exists()


@pytest.mark.parametrize(
    "webhook",
    [
        "ftp://127.0.0.1/hook",
        "javascript:alert(1)",
        "",
        "http://",
        "http://127.0.0.1/a b",
        "http://user:pw@127.0.0.1/hook",
        "http://127.0.0.1@example.com/hook",
        "http://127.0.0.1:notaport/hook",
        "http://127.0.0.1:65536/hook",
        "http://[::1/hook",
        "http://:80/hook",
        "http://127.0.0.1/\x01",
        "http://127.0.0.1/" + "a" * 2000,
    ],
)
def test_a_webhook_that_is_no_http_url_is_refused_as_malformed_R_API_3(thread, webhook_config, webhook):
    response = submit(thread, webhook=webhook)
    assert response.status_code == 422, response.content
    assert response.json()["error"]["code"] == "invalid_input"
    assert not AgentRun.objects.exists()
    # The service refuses what the schema refuses.
    if webhook:
        with pytest.raises(InvalidInput):
            webhook_checked(webhook)


def test_a_webhook_with_a_port_and_query_on_an_allowed_host_is_taken_R_API_3(thread, webhook_config):
    for webhook in ("http://127.0.0.1:8080/hooks?x=1#f", "https://127.0.0.1", "HTTP://127.0.0.1:65535"):
        response = submit(thread, webhook=webhook)
        assert response.status_code == 202, response.content
        assert AgentRun.objects.get(pk=response.json()["run_id"]).webhook == webhook


def test_webhooks_not_configured_are_refused_R_API_3(thread, webhook_config):
    webhook_config.WEBHOOK_SECRET = ""
    response = submit(thread, webhook="http://127.0.0.1/hook")
    assert response.status_code == 403 and response.json()["error"]["reason"] == "not_configured"
    webhook_config.WEBHOOK_SECRET = SECRET
    webhook_config.WEBHOOK_ALLOWED_HOSTS = []
    response = submit(thread, webhook="http://127.0.0.1/hook")
    assert response.status_code == 403 and response.json()["error"]["reason"] == "not_configured"
    assert not AgentRun.objects.exists()
    # Without a webhook nothing changes.
    assert submit(thread).status_code == 202


def test_allowed_hosts_match_a_name_or_a_domain_and_its_subdomains_R_API_3():
    allowed = ["hooks.example.com", ".example.org"]
    assert host_allowed("hooks.example.com", allowed)
    assert not host_allowed("evil-hooks.example.com", allowed)
    assert not host_allowed("example.com", allowed)
    assert host_allowed("example.org", allowed) and host_allowed("a.b.example.org", allowed)
    assert not host_allowed("badexample.org", allowed)


def test_each_end_of_an_interrupted_run_and_its_resume_is_announced_R_API_3(
    user, replay_models, webhook_config, receiver
):
    run = ended_run(user, "approval_send_email", receiver.url, "Mail Bob")
    assert run.status == "interrupted"
    one_pass()
    ledger.run_request_cancel(user=user, run_id=run.id)  # gives the approval up: a second end
    one_pass()
    bodies = [json.loads(r.body) for r in receiver.received]
    assert [b["status"] for b in bodies] == ["interrupted", "cancelled"]
    assert bodies[0]["pending_approval"] and bodies[1]["run_id"] == str(run.id)
    deliveries = list(WebhookDelivery.objects.order_by("created_at").values_list("id", "run_status"))
    assert [status for _, status in deliveries] == ["interrupted", "cancelled"]
    assert [r.headers["x-yuxi-delivery"] for r in receiver.received] == [str(pk) for pk, _ in deliveries]

    # A resume names its own webhook.
    again = ended_run(user, "approval_send_email", receiver.url, "Mail Bob")
    one_pass()
    response = Client().post(
        f"/api/runs/{again.id}/resume",
        json.dumps({"request_id": uuid.uuid4().hex, "decisions": [{"type": "approve"}], "webhook": receiver.url}),
        content_type="application/json",
        headers=bearer(user),
    )
    assert response.status_code == 202, response.content
    resume_id = uuid.UUID(response.json()["run_id"])
    run_execute(run_id=resume_id, owner="in-process")
    one_pass()
    last = json.loads(receiver.received[-1].body)
    assert last["run_id"] == str(resume_id) and last["status"] == "completed"
    assert last["resumed_from"] == str(again.id)


def test_a_run_of_a_deleted_thread_is_not_announced_R_API_3(user, replay_models, webhook_config, receiver):
    run = ended_run(user, "plain_answer", receiver.url)
    response = Client().delete(f"/api/threads/{run.thread_id}", headers=bearer(user))
    assert response.status_code == 200, response.content
    # The erasure blanked the run's webhook: its end is never queued.
    queued, sent = one_pass()
    assert queued == 0 and sent.attempts == 0
    assert receiver.received == [] and not WebhookDelivery.objects.exists()

    # A delivery queued before its thread was deleted (a race the erasure
    # did not see) is skipped, not sent.
    run = ended_run(user, "plain_answer", receiver.url)
    assert deliveries_queue() == 1
    Conversation.objects.filter(pk=run.thread_id).update(status="deleted")
    sent = deliveries_send(render=run_body)
    assert sent.skipped == 1 and sent.attempts == 0 and receiver.received == []
    delivery = WebhookDelivery.objects.get()
    assert delivery.status == "skipped" and "deleted" in delivery.last_error
    assert delivery.attempts == 0 and not WebhookAttempt.objects.exists()


def test_a_run_without_webhook_is_not_queued_R_API_3(user, replay_models, webhook_config, receiver):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    response = submit(thread)
    run_execute(run_id=uuid.UUID(response.json()["run_id"]), owner="in-process")
    assert one_pass()[0] == 0 and not WebhookDelivery.objects.exists()


def test_two_deliverers_at_once_send_each_delivery_once_R_API_3(user, replay_models, webhook_config, receiver):
    runs = [ended_run(user, "plain_answer", receiver.url, f"turn {i}") for i in range(6)]
    assert deliveries_queue() == 6
    receiver.default = "slow"
    receiver.slow_seconds = 0.2
    results = []

    def deliver():
        try:
            results.append(deliveries_send(render=run_body))
        finally:
            connection.close()

    workers = [threading.Thread(target=deliver) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert sum(r.delivered for r in results) == 6
    ids = [r.headers["x-yuxi-delivery"] for r in receiver.received]
    assert len(ids) == len(set(ids)) == 6
    assert {json.loads(r.body)["run_id"] for r in receiver.received} == {str(run.id) for run in runs}


def test_an_open_terminal_transaction_holds_the_queue_back_R_API_3(
    user, replay_models, webhook_config, receiver, db_name
):
    import psycopg

    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    slow = AgentRun.objects.get(pk=submit(thread, webhook=receiver.url).json()["run_id"])
    settings = connection.settings_dict
    other = psycopg.connect(
        host=settings["HOST"] or "127.0.0.1", port=settings["PORT"] or 5432, user=settings["USER"], dbname=db_name
    )
    try:
        # A terminal transaction that has set finished_at but not committed.
        other.execute(
            "UPDATE audit_agentrun SET status = 'failed', error_type = 'slow', finished_at = clock_timestamp() "
            "WHERE id = %s",
            [slow.id],
        )
        late = ended_run(user, "plain_answer", receiver.url)  # ends and commits after it
        assert deliveries_queue() == 0
        other.commit()
    finally:
        other.close()
    assert deliveries_queue() == 2
    deliveries_send(render=run_body)
    assert {json.loads(r.body)["run_id"] for r in receiver.received} == {str(slow.id), str(late.id)}


def test_the_command_and_the_beat_task_run_the_same_pass_R_API_3(user, replay_models, webhook_config, receiver, capsys):
    from webhooks.tasks import deliver

    ended_run(user, "plain_answer", receiver.url)
    call_command("deliver_webhooks", "--once")
    assert "1 queued, 1 delivered, 0 to retry, 0 given up, 0 skipped" in capsys.readouterr().out
    ended_run(user, "plain_answer", receiver.url)
    assert deliver() == 1
    assert len(receiver.received) == 2


def test_deliveries_and_attempts_in_the_admin_and_sent_again_R_API_3(
    user, staff_user, replay_models, webhook_config, receiver
):
    webhook_config.WEBHOOK_MAX_ATTEMPTS = 1
    receiver.default = "500"
    ended_run(user, "plain_answer", receiver.url)
    one_pass()
    delivery = WebhookDelivery.objects.get()
    assert delivery.status == "failed"

    admin = Client()
    admin.force_login(staff_user)
    listing = admin.get("/admin/webhooks/webhookdelivery/")
    assert listing.status_code == 200 and str(delivery.id) in listing.content.decode()
    page = admin.get(f"/admin/webhooks/webhookdelivery/{delivery.id}/change/")
    assert page.status_code == 200
    content = page.content.decode()
    assert "HTTP 500" in content and receiver.url in content
    assert "Webhook deliveries" in listing.content.decode()  # not "deliverys"
    # A given-up delivery has no next attempt; durations are whole ms.
    next_attempt = content.split("Next attempt:</label>", 1)[1].split("</div>", 1)[0]
    assert re.sub(r"<[^>]+>", "", next_attempt).strip() == "-", next_attempt
    duration = WebhookAttempt.objects.get(delivery=delivery).duration_ms
    assert f"{duration:,.0f} ms" in content and str(duration) not in content

    response = admin.post(
        "/admin/webhooks/webhookdelivery/",
        {"action": "send_again", "_selected_action": [str(delivery.id)]},
    )
    assert response.status_code == 302
    delivery.refresh_from_db()
    assert delivery.status == "pending" and delivery.resent_after == 1
    receiver.default = "ok"
    assert deliveries_send(render=run_body).delivered == 1
    numbers = list(WebhookAttempt.objects.filter(delivery=delivery).values_list("number", "status_code"))
    assert numbers == [(1, 500), (2, 200)]


def test_attempts_are_counted_and_the_backlog_is_a_gauge_R_API_3_R_OPS_1(user, replay_models, webhook_config):
    from tests.ops.test_metrics import delta, scrape, value

    down = WebhookReceiver()
    port, url = down.port, down.url
    down.stop()
    ended_run(user, "plain_answer", url)
    before = scrape()
    one_pass()
    WebhookDelivery.objects.update(created_at=timezone.now() - timedelta(seconds=600))
    during = scrape()
    assert delta(before, during, "yuxi_webhook_attempts_total", status="retrying") == 1
    assert value(during, "yuxi_webhook_deliveries_pending") == 1
    assert 599 <= value(during, "yuxi_webhook_deliveries_pending_oldest_age_seconds") < 700

    receiver = WebhookReceiver(port=port)
    try:
        deliveries_send(render=run_body)
    finally:
        receiver.stop()
    after = scrape()
    assert delta(during, after, "yuxi_webhook_attempts_total", status="delivered") == 1
    assert value(after, "yuxi_webhook_deliveries_pending") == 0
    assert value(after, "yuxi_webhook_deliveries_pending_oldest_age_seconds") == 0


def test_a_skipped_delivery_counts_no_attempt_R_API_3_R_OPS_1(user, replay_models, webhook_config):
    """A delivery skipped without a request (its host no longer allowed)
    keeps ``attempts`` equal to the requests it had, and counts as skipped,
    not as an attempt."""
    from tests.ops.test_metrics import delta, scrape

    down = WebhookReceiver()
    url = down.url
    down.stop()
    ended_run(user, "plain_answer", url)
    one_pass()  # one real attempt, refused: the delivery waits
    delivery = WebhookDelivery.objects.get()
    assert delivery.attempts == 1 and WebhookAttempt.objects.count() == 1

    webhook_config.WEBHOOK_ALLOWED_HOSTS = ["hooks.example.com"]
    before = scrape()
    sent = deliveries_send(render=run_body)
    after = scrape()
    assert sent.skipped == 1 and sent.attempts == 0
    delivery.refresh_from_db()
    assert delivery.status == "skipped" and "not sent" in delivery.last_error
    assert delivery.attempts == WebhookAttempt.objects.filter(delivery=delivery).count() == 1
    assert delta(before, after, "yuxi_webhook_deliveries_skipped_total") == 1
    for status in ("delivered", "retrying", "failed", "skipped"):
        assert delta(before, after, "yuxi_webhook_attempts_total", status=status) == 0


@pytest.mark.parametrize("erasure", ["thread", "user"])
def test_an_erasure_erases_the_webhook_urls_and_sends_nothing_more_R_API_3_R_GOV_2(
    user, replay_models, webhook_config, erasure
):
    from governance.services import user_erase
    from tests.governance.helpers import MARKER, scan

    down = WebhookReceiver()
    url = f"http://127.0.0.1:{down.port}/hooks/{MARKER}?user={MARKER}"
    down.stop()
    run = ended_run(user, "plain_answer", url)
    one_pass()  # the receiver is down: the delivery waits
    assert scan(MARKER) == {"audit_agentrun.webhook", "webhooks_webhookdelivery.url"}

    if erasure == "thread":
        assert Client().delete(f"/api/threads/{run.thread_id}", headers=bearer(user)).status_code == 200
    else:
        user_erase(username=user.username, actor="test")
    assert scan(MARKER) == set()
    delivery = WebhookDelivery.objects.get()
    assert delivery.status == "skipped" and delivery.url == ""
    receiver = WebhookReceiver(port=down.port)
    try:
        assert deliveries_send(render=run_body).attempts == 0
        assert receiver.received == []
    finally:
        receiver.stop()


@pytest.mark.parametrize("char", ["\x85", "\xa0", "\u2028", "\ufeff", "\x1f", "\x7f"])
def test_white_space_in_a_webhook_is_malformed_for_the_schema_pydantic_and_the_service_R_API_3_R_READ_6(
    thread, webhook_config, char
):
    url = f"http://127.0.0.1/hook{char}x"
    response = submit(thread, webhook=url)
    assert response.status_code == 422, response.content
    with pytest.raises(InvalidInput):
        webhook_checked(url)
    schema = Client().get("/api/openapi.json").json()["components"]["schemas"]["RunIn"]["properties"]["webhook"]
    [text] = [s for s in schema.get("anyOf", [schema]) if s.get("type") == "string"]
    assert re.search(text["pattern"], url) is None
