"""The ``/metrics`` exposition and the queue gauges read at scrape time (R-OPS-1).

:func:`render` builds the Prometheus text that ``GET /metrics`` serves. With
``PROMETHEUS_MULTIPROC_DIR`` set it sums the values that every process of
the deployment (the web server, each Celery worker and prefork child) wrote
there through :mod:`ops.metrics`; without it it shows only this process's
own values (the workers' counters are then missing).

To those it adds gauges read from PostgreSQL at each scrape
(:class:`QueueCollector`): pending-queue depth, age of the oldest startable
pending run, active runs, and ``yuxi_queue_gauges_up`` (0 when the database
did not answer). They are read, never recorded, so they are right however
many processes run.

It reads the run table, so it sits in the reads layer: it may import
:mod:`ops.metrics` and the foundation below it, :mod:`audit.models`,
Django and ``prometheus_client``; only the interfaces (:mod:`ops.views`)
import it.
"""

from __future__ import annotations

import logging

from django.db import connection, transaction
from django.db.models import Count, Exists, Min, OuterRef, Q
from django.utils import timezone
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily

from audit.models import AgentRun
from ops.metric_files import compact_dead_processes, forget_dead_processes, scrape_lock
from ops.metrics import multiprocess_dir
from webhooks.models import WebhookDelivery

log = logging.getLogger(__name__)


class QueueCollector:
    """Gauges read from PostgreSQL at scrape time, in one short query with a
    statement timeout: pending runs, the age of the oldest pending run that
    nothing but a worker keeps waiting (no running, cancelling or
    approval-waiting run in its thread — R-RUN-2 holds the others back on
    purpose), and running / cancel_requested runs. When the database does
    not answer, ``yuxi_queue_gauges_up`` is 0 and the other gauges are
    absent."""

    def collect(self):
        up = GaugeMetricFamily("yuxi_queue_gauges_up", "1 when the queue gauges below were read from the database.")
        try:
            figures = queue_figures()
        except Exception as exc:
            log.warning("metrics: queue gauges not read: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield GaugeMetricFamily(
            "yuxi_runs_pending", "Runs waiting to start (status pending).", value=figures["pending"]
        )
        yield GaugeMetricFamily(
            "yuxi_runs_pending_oldest_age_seconds",
            "Age of the oldest pending run that waits only for a worker (0 when none).",
            value=figures["oldest_ready_age_seconds"],
        )
        active = GaugeMetricFamily("yuxi_runs_active", "Runs holding a lease now, by status.", labels=["status"])
        for status in ("running", "cancel_requested"):
            active.add_metric([status], figures[status])
        yield active
        yield GaugeMetricFamily(
            "yuxi_webhook_deliveries_pending",
            "Webhook deliveries not yet accepted by their receiver nor given up (R-API-3).",
            value=figures["webhooks_pending"],
        )
        yield GaugeMetricFamily(
            "yuxi_webhook_deliveries_pending_oldest_age_seconds",
            "Age of the oldest pending webhook delivery since it was queued (0 when none).",
            value=figures["webhooks_oldest_age_seconds"],
        )


def queue_figures() -> dict[str, float]:
    """``{pending, oldest_ready_age_seconds, running, cancel_requested,
    webhooks_pending, webhooks_oldest_age_seconds}`` from two queries
    (served by the status and thread indexes of the run table, and the
    pending deliveries' partial index); bounded by a 2 s statement timeout
    on PostgreSQL."""
    Status = AgentRun.Status
    holding = AgentRun.objects.filter(thread_id=OuterRef("thread_id")).filter(
        Q(status__in=(Status.RUNNING, Status.CANCEL_REQUESTED)) | Q(status=Status.INTERRUPTED, resumed_by__isnull=True)
    )
    try:
        with transaction.atomic():
            if connection.vendor == "postgresql":
                with connection.cursor() as cursor:
                    cursor.execute("SET LOCAL statement_timeout = 2000")
            figures = AgentRun.objects.filter(status__in=AgentRun.ACTIVE_STATUSES).aggregate(
                pending=Count("id", filter=Q(status=Status.PENDING)),
                running=Count("id", filter=Q(status=Status.RUNNING)),
                cancel_requested=Count("id", filter=Q(status=Status.CANCEL_REQUESTED)),
                oldest_ready=Min("created_at", filter=Q(status=Status.PENDING) & ~Exists(holding)),
            )
            # The partial index of pending deliveries (webhook_delivery_due_idx).
            webhooks = WebhookDelivery.objects.filter(status=WebhookDelivery.Status.PENDING).aggregate(
                pending=Count("id"), oldest=Min("created_at")
            )
    finally:
        if not connection.in_atomic_block:
            connection.close()
    now = timezone.now()
    oldest = figures.pop("oldest_ready")
    figures["oldest_ready_age_seconds"] = max(0.0, (now - oldest).total_seconds()) if oldest else 0.0
    figures["webhooks_pending"] = webhooks["pending"]
    oldest = webhooks["oldest"]
    figures["webhooks_oldest_age_seconds"] = max(0.0, (now - oldest).total_seconds()) if oldest else 0.0
    return figures


def render() -> bytes:
    """The Prometheus text exposition of every process (multiprocess mode)
    or of this process, plus the database gauges. In multiprocess mode the
    files of processes that ended are tidied first (live gauges dropped,
    counters and histograms summed into the archive:
    :mod:`ops.metric_files`), and the files are merged once, under the
    shared scrape lock."""
    # auto_describe off: on, registering a collector without describe()
    # runs its collect() once more (the whole merge, the database query).
    registry = CollectorRegistry(auto_describe=False)
    path = multiprocess_dir()
    if path:
        forget_dead_processes(path)
        try:
            compact_dead_processes(path)
        except OSError as exc:
            log.warning("metrics: the files of ended processes were not compacted: %s", exc)
        multiprocess.MultiProcessCollector(registry)
    registry.register(QueueCollector())
    if not path:
        return generate_latest(REGISTRY) + generate_latest(registry)
    with scrape_lock(path):
        return generate_latest(registry)
