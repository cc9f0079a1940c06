"""``manage.py deliver_webhooks``: the delivery passes of Celery beat's
``webhooks.deliver`` without beat (R-API-3)."""

from __future__ import annotations

import time

from django.core.management.base import BaseCommand

from core.config import get_config
from webhooks.body import run_body
from webhooks.services import deliveries_queue, deliveries_send
from yuxi_project.runtime import tune_gc


class Command(BaseCommand):
    help = (
        "Queue a delivery for every run that ended with a webhook and send the due ones (R-API-3). "
        "--once: one pass until nothing is due now; otherwise a pass every WEBHOOK_INTERVAL_SECONDS."
    )

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="One pass, then exit.")

    def handle(self, *args, once: bool = False, **options):
        interval = get_config().WEBHOOK_INTERVAL_SECONDS
        while True:
            queued = deliveries_queue()
            result = deliveries_send(render=run_body, max_seconds=None if once else interval)
            if once or queued or result.attempts or result.skipped:
                self.stdout.write(
                    f"{queued} queued, {result.delivered} delivered, {result.retrying} to retry, "
                    f"{result.failed} given up, {result.skipped} skipped"
                )
            if once:
                return
            # A long-lived loop: once its first pass has loaded what it uses,
            # the loaded code goes out of the collector's way (once).
            tune_gc()
            time.sleep(interval)
