"""The broker settings a worker starts with (R-RUN-9): the product's Redis
transport whenever REDIS_URL is set, and a rediss:// URL verifies the
server's certificate unless the URL says otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = (
    "import json, django; django.setup(); from django.conf import settings as s; "
    "print(json.dumps([s.CELERY_BROKER_URL, getattr(s, 'CELERY_BROKER_TRANSPORT', None), "
    "str(getattr(s, 'CELERY_BROKER_USE_SSL', None))]))"
)


def _broker_settings(redis_url: str) -> list:
    env = {**os.environ, "REDIS_URL": redis_url, "DJANGO_SETTINGS_MODULE": "yuxi_project.settings"}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "url, transport, use_ssl",
    [
        ("redis://127.0.0.1:6379/0", "yuxi_project.broker:Transport", "None"),
        (
            "rediss://cache.example:6380/0",
            "yuxi_project.broker:Transport",
            "{'ssl_cert_reqs': <VerifyMode.CERT_REQUIRED: 2>}",
        ),
        ("rediss://cache.example:6380/0?ssl_cert_reqs=none", "yuxi_project.broker:Transport", "None"),
    ],
)
def test_workers_use_the_products_redis_transport_and_verify_tls_by_default_R_RUN_9(url, transport, use_ssl):
    broker_url, broker_transport, broker_ssl = _broker_settings(url)
    assert broker_transport == transport and broker_ssl == use_ssl
    assert broker_url == url


def test_the_workers_consumer_starts_without_mingle_and_gossip_R_RUN_9():
    """A real worker with the product's consumer (``CELERY_WORKER_CONSUMER``)
    connects, starts remote control and its task consumer, and leaves
    Mingle and Gossip off (yuxi_project.broker.Consumer): its log shows no
    Mingle exchange and no Gossip start."""
    from tests.e2e.stack import start

    queue = f"consumer-probe-{os.getpid()}"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "yuxi_project.settings", "CELERY_QUEUE": queue}
    worker = start(
        queue,
        [sys.executable, "-m", "celery", "-A", "yuxi_project", "worker", "-Q", queue, "-n", f"{queue}@%h"]
        + ["--pool=solo", "-l", "debug"],
        env,
    )
    try:
        worker.wait_for_line(" ready.")
    finally:
        worker.stop()
    text = worker.output()
    assert "Consumer: Starting Control" in text and "Consumer: Starting Tasks" in text
    assert "Consumer: Starting Mingle" not in text and "mingle:" not in text
    assert "Consumer: Starting Gossip" not in text
