"""Webhooks end to end (R-API-3): real processes — uvicorn, a prefork
Celery worker with beat serving the webhook queue, the replay model server —
and a real HTTP receiver in this process that is down when the run ends.
The run's end is announced once the receiver is back: nothing is lost, the
body is the run as the API serves it, signed with the shared secret, and
every attempt is recorded."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid

import pytest

from tests.conftest import bearer
from tests.waiting import WAIT_SECONDS
from tests.webhooks.receiver import WebhookReceiver
from webhooks.models import WebhookAttempt, WebhookDelivery

from .stack import create_thread, start_stack, wait_for_status

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

SECRET = f"whsec-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def webhook_stack(e2e_database_url, django_db_blocker):
    from django.conf import settings

    stack = start_stack(
        database_url=e2e_database_url,
        redis_url=settings.CONFIG.REDIS_URL,
        workers=0,
        env={
            "WEBHOOK_ALLOWED_HOSTS": "127.0.0.1",
            "WEBHOOK_SECRET": SECRET,
            "WEBHOOK_QUEUE": f"e2e-webhooks-{uuid.uuid4().hex[:8]}",
            "WEBHOOK_INTERVAL_SECONDS": "0.5",
            "WEBHOOK_SETTLE_SECONDS": "0.5",
            "WEBHOOK_RETRY_BASE_SECONDS": "0.5",
            "WEBHOOK_RETRY_MAX_SECONDS": "1",
            "WEBHOOK_TIMEOUT_SECONDS": "2",
        },
    )
    try:
        stack.start_worker(beat=True)
        yield stack
    finally:
        stack.stop()


def wait_until(condition, what: str):
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.1)


def test_a_run_ending_while_the_receiver_is_down_is_announced_when_it_is_back_R_API_3(webhook_stack, user):
    down = WebhookReceiver()
    port, url = down.port, down.url
    down.stop()

    with webhook_stack.client(bearer(user)) as client:
        thread_id = create_thread(client, "replay:tool_then_answer")
        submitted = client.post(
            f"/api/threads/{thread_id}/runs",
            json={"request_id": uuid.uuid4().hex, "input": {"text": "Weather in Paris?"}, "webhook": url},
        )
        assert submitted.status_code == 202, submitted.text
        run_id = submitted.json()["run_id"]
        wait_for_status(client, run_id, {"completed"})

        # The receiver is down: attempts fail and are recorded, nothing is given up.
        wait_until(lambda: WebhookAttempt.objects.filter(delivery__run_id=run_id).count() >= 2, "two failed attempts")
        delivery = WebhookDelivery.objects.get(run_id=run_id)
        assert delivery.status == "pending" and "ConnectionError" in delivery.last_error

        receiver = WebhookReceiver(port=port)
        try:
            wait_until(lambda: receiver.received, "the delivery")
            wait_until(
                lambda: WebhookDelivery.objects.get(pk=delivery.pk).status == "delivered", "the delivery recorded"
            )
            [request] = receiver.received
            expected = "sha256=" + hmac.new(SECRET.encode(), request.body, hashlib.sha256).hexdigest()
            assert hmac.compare_digest(request.headers["x-yuxi-signature"], expected)
            assert request.headers["x-yuxi-delivery"] == str(delivery.id)
            assert json.loads(request.body) == client.get(f"/api/runs/{run_id}").json()
        finally:
            receiver.stop()

    delivery.refresh_from_db()
    attempts = list(WebhookAttempt.objects.filter(delivery=delivery).order_by("number"))
    assert delivery.attempts == len(attempts) >= 3
    assert [a.status_code for a in attempts][-1] == 200 and all(a.status_code is None for a in attempts[:-1])
