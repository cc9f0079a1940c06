"""Losing Redis while a worker holds unacknowledged messages (R-RUN-9).

With ``task_acks_late`` a busy worker holds the message of the task it
runs. When Redis dies, Celery collects the broken connection and closes
it; kombu's Redis channel then restores the unacknowledged messages with a
client built from the collected connection, and (kombu 5.7) the
AttributeError that follows ends the worker ("Unrecoverable error"); the
late ack of the task that was running does the same once it ends. The
broker transport of :mod:`yuxi_project.broker` keeps the worker alive.

The first test kills a private ``redis-server`` under a real ``celery
worker`` of the project (its settings, its transport) while a long task
runs; the second checks the normal restore still happens on a working
connection.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection
from kombu import Connection, Exchange, Queue

from tests.e2e.stack import database_url_of, start
from yuxi_project.celery import app

from .harness import PrivateRedis

HOLD = "tests.faults.hold"


@pytest.fixture
def private_redis():
    server = PrivateRedis()
    server.start()
    yield server
    server.kill9()


def wait_for(predicate, timeout: float, what: str, worker=None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            tail = worker.output()[-4000:] if worker is not None else ""
            raise AssertionError(f"{what} not within {timeout}s\n{tail}")
        time.sleep(0.1)


def send_hold(redis_url: str, queue: str, seconds: float, marker: Path) -> None:
    """Publish one ``hold`` task to ``queue`` on the broker at ``redis_url``
    with the project's Celery configuration (and transport)."""
    with app.connection_for_write(redis_url) as conn:
        app.send_task(HOLD, args=[seconds, str(marker)], queue=Queue(queue), producer=conn.Producer())


@pytest.mark.faults
@pytest.mark.django_db(transaction=True)
def test_a_worker_holding_unacked_messages_survives_redis_killed_and_keeps_consuming_R_RUN_9(
    private_redis, tmp_path, django_db_setup
):
    queue = f"broker-loss-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "DATABASE_URL": database_url_of(connection.settings_dict),
        "REDIS_URL": private_redis.url,
        "CELERY_QUEUE": queue,
        "PYTHONUNBUFFERED": "1",
        "PYTHONWARNINGS": "ignore",
    }
    worker = start(
        f"broker-loss-worker-{queue}",
        [sys.executable, "-m", "celery", "-A", "yuxi_project", "worker", "--include", "tests.faults.broker_tasks"]
        + ["-Q", queue, "-n", f"{queue}@%h", "--pool=prefork", "--concurrency=2", "-l", "info"],
        env,
    )
    try:
        worker.wait_for_line(" ready.", timeout=180)
        assert "yuxi_project.broker:Transport" in worker.output(), "the worker does not use the project's transport"
        long_marker, after_loss, after_late_ack = tmp_path / "long", tmp_path / "after-loss", tmp_path / "after-ack"

        # A long task: its message stays unacknowledged while Redis dies.
        send_hold(private_redis.url, queue, 12, long_marker)
        wait_for(lambda: f"Task {HOLD}[" in worker.output(), 60, "the long task started", worker)
        time.sleep(1.0)
        private_redis.kill9()
        time.sleep(1.0)
        private_redis.start()  # back, empty

        # The worker reconnects and consumes a new task while the long one
        # still runs...
        wait_for(lambda: worker.output().count("Connected to ") >= 2, 60, "the worker reconnected", worker)
        send_hold(private_redis.url, queue, 0, after_loss)
        wait_for(after_loss.exists, 60, "a task sent after Redis came back ran", worker)

        # ...and still after the long task ended and its message could not
        # be acknowledged on the lost connection.
        wait_for(long_marker.exists, 60, "the long task ended", worker)
        time.sleep(1.0)
        send_hold(private_redis.url, queue, 0, after_late_ack)
        wait_for(after_late_ack.exists, 60, "a task sent after the late ack ran", worker)

        output = worker.output()
        assert worker.popen.poll() is None, f"the worker exited after losing Redis:\n{output[-4000:]}"
        assert "Unrecoverable error" not in output, output[-4000:]
        assert "not restoring 1 unacknowledged message(s)" in output, output[-4000:]
    finally:
        worker.stop()


def test_closing_a_working_channel_still_restores_its_unacknowledged_messages():
    """A graceful close (the broker is fine) hands the unacknowledged
    messages back to their queue, as kombu does."""
    name = f"broker-restore-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
    with Connection(settings.CONFIG.REDIS_URL, transport=settings.CELERY_BROKER_TRANSPORT) as conn:
        assert type(conn.transport).__module__ == "yuxi_project.broker"
        try:
            with conn.Producer() as producer:
                producer.publish({"n": 1}, exchange=queue.exchange, routing_key=name, declare=[queue])
            channel = conn.channel()
            message = queue(channel).get(no_ack=False)
            assert message is not None and message.payload == {"n": 1}
            assert queue(conn.default_channel).get() is None  # held, unacknowledged
            channel.close()
            again = queue(conn.default_channel).get(no_ack=False)
            assert again is not None and again.payload == {"n": 1}
            again.ack()
        finally:
            queue(conn.default_channel).delete()


@pytest.mark.faults
def test_closing_a_channel_while_redis_is_down_gives_its_unacknowledged_messages_up_without_raising_R_RUN_9(
    private_redis, caplog
):
    """kombu's restore raises Redis's ConnectionError out of
    ``Channel.close`` when Redis is gone; the channel closes, and the late
    ack of one of its messages raises nothing either."""
    name = f"broker-down-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
    conn = Connection(private_redis.url, transport=settings.CELERY_BROKER_TRANSPORT)
    try:
        with conn.Producer() as producer:
            producer.publish({"n": 1}, exchange=queue.exchange, routing_key=name, declare=[queue])
        channel = conn.channel()
        message = queue(channel).get(no_ack=False)
        assert message is not None
        private_redis.kill9()
        with caplog.at_level(logging.WARNING, logger="yuxi_project.broker"):
            channel.close()
        assert "not restoring 1 unacknowledged message(s)" in caplog.text
        message.ack()  # the run ended after the connection was lost
    finally:
        conn.collect()
