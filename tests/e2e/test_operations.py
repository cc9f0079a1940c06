"""Operations end to end (R-OPS-1): real processes — uvicorn, a prefork
Celery worker, the replay model server — sharing one
``PROMETHEUS_MULTIPROC_DIR``, logging JSON lines, on a private Redis that the
test stops and starts again.

* ``/metrics`` scraped from the web process after completed, failed and
  cancelled runs (ended in worker children and in the web process) agrees
  with the database;
* ``/readyz`` is 200, goes 503 naming Redis (and the worker) while the
  private Redis is stopped, and comes back to 200;
* the JSON log lines of the worker and the web carry the run, thread,
  request and worker ids.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from audit.models import AgentRun
from conversations.models import Message
from tests.conftest import bearer
from tests.waiting import WAIT_SECONDS

from .stack import PrivateRedis, Stack, create_thread, start_stack, wait_for_status

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

METRICS_TOKEN = f"scrape-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def ops_stack(e2e_database_url, django_db_blocker):
    redis_server = PrivateRedis()
    redis_server.start()
    multiproc_dir = Path(tempfile.mkdtemp(prefix="yuxi-prometheus-"))
    stack = start_stack(
        database_url=e2e_database_url,
        redis_url=redis_server.url,
        workers=0,
        lease_ttl=6.0,
        env={
            "PROMETHEUS_MULTIPROC_DIR": str(multiproc_dir),
            "METRICS_TOKEN": METRICS_TOKEN,
            "LOG_FORMAT": "json",
            "READYZ_TIMEOUT_SECONDS": "3",
        },
    )
    try:
        # No beat: this stack's sweeper must not end other tests' runs (they
        # would count here).
        stack.start_worker("ops-worker", concurrency=2, beat=False)
        yield stack, redis_server
    finally:
        stack.stop()
        redis_server.stop()
        shutil.rmtree(multiproc_dir, ignore_errors=True)


def scrape(stack: Stack) -> dict[tuple[str, tuple], float]:
    with stack.client({"Authorization": f"Bearer {METRICS_TOKEN}"}) as client:
        response = client.get("/metrics")
    assert response.status_code == 200, response.text
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def summed(samples, name: str, **match) -> float:
    """The sum of ``name`` over every label set that contains ``match``."""
    return sum(
        value
        for (sample_name, labels), value in samples.items()
        if sample_name == name and all((key, val) in labels for key, val in match.items())
    )


def by_label(before, after, name: str, *keys: str) -> Counter:
    """Per-label-tuple deltas of ``name`` between two scrapes."""
    deltas: Counter = Counter()
    for (sample_name, labels), value in after.items():
        if sample_name == name:
            as_dict = dict(labels)
            delta = value - before.get((sample_name, labels), 0.0)
            if delta:
                deltas[tuple(as_dict[key] for key in keys)] += delta
    return deltas


def submit(client: httpx.Client, scenario: str, text: str = "hello") -> tuple[str, str]:
    thread_id = create_thread(client, f"replay:{scenario}")
    response = client.post(
        f"/api/threads/{thread_id}/runs", json={"request_id": uuid.uuid4().hex, "input": {"text": text}}
    )
    assert response.status_code == 202, response.text
    return thread_id, response.json()["run_id"]


def test_metrics_after_completed_failed_and_cancelled_runs_agree_with_the_database_R_OPS_1(ops_stack, user):
    stack, _redis = ops_stack
    with stack.client() as anonymous:
        assert anonymous.get("/metrics").status_code == 401
    before = scrape(stack)
    assert summed(before, "yuxi_queue_gauges_up") == 1

    with stack.client(bearer(user)) as client:
        runs = [
            submit(client, "plain_answer")[1],
            submit(client, "tool_then_answer", "weather in Paris?")[1],
            submit(client, "model_http_error")[1],
        ]
        # Cancelled while running, in the worker.
        _, slow = submit(client, "slow_answer")
        wait_for_status(client, slow, {"running"})
        # A live event stream is open while the run streams.
        with client.stream("GET", f"/api/runs/{slow}/events") as events:
            lines = events.iter_lines()
            assert next(lines).startswith("retry:")
            during = scrape(stack)
            assert summed(during, "yuxi_sse_streams_open") >= 1
        assert client.post(f"/api/runs/{slow}/cancel").status_code == 202
        runs.append(slow)
        # Cancelled while pending, in the web process: a second turn waits
        # behind a slow run of its thread.
        thread_id, busy = submit(client, "slow_answer")
        queued = client.post(
            f"/api/threads/{thread_id}/runs", json={"request_id": uuid.uuid4().hex, "input": {"text": "next"}}
        ).json()["run_id"]
        assert client.get(f"/api/runs/{queued}").json()["status"] == "pending"
        assert client.post(f"/api/runs/{queued}/cancel").json()["status"] == "cancelled"
        wait_for_status(client, busy, {"running"})
        assert client.post(f"/api/runs/{busy}/cancel").status_code == 202
        runs += [queued, busy]
        for run_id in runs:
            wait_for_status(client, run_id, {"completed", "failed", "cancelled", "interrupted"})

    # The terminal counts land after commit; give the last one a moment
    # (a loaded 2-core machine needs several).
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        after = scrape(stack)
        if summed(after, "yuxi_runs_finished_total") - summed(before, "yuxi_runs_finished_total") >= len(runs):
            break
        assert time.monotonic() < deadline, (
            "run ends did not reach /metrics",
            by_label(before, after, "yuxi_runs_finished_total", "status", "error_type", "model"),
            list(AgentRun.objects.filter(pk__in=runs).values_list("status", "error_type", "model")),
        )
        time.sleep(0.2)

    db_runs = list(AgentRun.objects.filter(pk__in=runs))
    assert Counter(r.status for r in db_runs) == {"completed": 2, "failed": 1, "cancelled": 3}
    # Runs by status (and error type) agree with the database.
    expected = Counter((r.status, r.error_type.split(":")[0], r.model) for r in db_runs)
    assert by_label(before, after, "yuxi_runs_finished_total", "status", "error_type", "model") == expected
    started = [r for r in db_runs if r.started_at is not None]
    assert len(started) == 5
    assert sum(by_label(before, after, "yuxi_run_duration_seconds_count", "model").values()) == len(started)
    assert summed(after, "yuxi_lease_acquisitions_total") - summed(before, "yuxi_lease_acquisitions_total") == 5
    # Model calls, tokens and tool executions agree with the audit rows.
    model_rows = Message.objects.model_calls().filter(run__in=runs)
    assert by_label(before, after, "yuxi_model_calls_total", "status") == Counter(
        (row.execution_status,) for row in model_rows
    )
    for kind, key in (("input", "input_tokens"), ("output", "output_tokens")):
        tokens = sum((r.usage or {}).get(key, 0) for r in db_runs)
        assert tokens > 0
        assert by_label(before, after, "yuxi_model_tokens_total", "kind")[(kind,)] == tokens
    tool_rows = Message.objects.tool_executions().filter(run__in=runs)
    assert by_label(before, after, "yuxi_tool_executions_total", "tool", "status") == Counter(
        (row.tool_name, row.execution_status) for row in tool_rows
    )
    assert tool_rows.count() >= 1
    # Each kind of audit write was timed in the worker children.
    writes = by_label(before, after, "yuxi_audit_write_duration_seconds_count", "kind")
    # Every model row opens when its request is sent (R-MA-10); message-start
    # finds it only for calls that streamed (not the HTTP error's).
    assert writes[("model_open",)] == model_rows.exclude(started_at=None).count()
    assert 0 < writes[("model_start",)] < writes[("model_open",)]
    assert writes[("run_finish",)] == 5
    # The gauge is read from the database: it agrees with it. (Earlier test
    # modules may have left runs of their own behind in the shared test
    # database, so the figure is compared with the table, not with 0.)
    # A sweeper may end such a leftover between the two reads: read again.
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        gauge = summed(scrape(stack), "yuxi_runs_active")
        holding = AgentRun.objects.filter(
            status__in=(AgentRun.Status.RUNNING, AgentRun.Status.CANCEL_REQUESTED)
        ).count()
        if gauge == holding:
            break
        assert time.monotonic() < deadline, f"yuxi_runs_active says {gauge}, the database {holding}"
        time.sleep(0.2)
    assert not AgentRun.objects.filter(pk__in=runs, status__in=AgentRun.ACTIVE_STATUSES).exists()
    # The stream is closed.
    deadline = time.monotonic() + WAIT_SECONDS
    while summed(scrape(stack), "yuxi_sse_streams_open") != 0:
        assert time.monotonic() < deadline, "the closed event stream is still counted open"
        time.sleep(0.2)


def test_json_log_lines_carry_run_thread_request_and_worker_ids_R_OPS_1(ops_stack, user):
    stack, _redis = ops_stack
    with stack.client(bearer(user)) as client:
        thread_id, run_id = submit(client, "model_http_error")
        wait_for_status(client, run_id, {"failed"})
        missing = uuid.uuid4()
        response = client.get(f"/api/runs/{missing}", headers={"X-Request-ID": "e2e-ops-1"})
        assert response.status_code == 404 and response.headers["X-Request-ID"] == "e2e-ops-1"
    run = AgentRun.objects.get(pk=run_id)

    def json_lines(process) -> list[dict]:
        found = []
        for line in process.output().splitlines():
            if line.startswith("{"):
                found.append(json.loads(line))
        return found

    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        worker_lines = json_lines(stack.workers[0])
        in_run = [line for line in worker_lines if line.get("run_id") == run_id]
        if any(f"run {run_id} failed" in line["message"] for line in in_run):
            break
        assert time.monotonic() < deadline, f"no JSON line of run {run_id} in the worker log"
        time.sleep(0.2)
    for line in worker_lines:
        assert {"time", "level", "logger", "message", "run_id", "thread_id", "request_id", "worker"} <= set(line)
    for line in in_run:
        assert line["thread_id"] == thread_id
        assert line["worker"] == run.lease_owner  # the lease owner: host:pid:random

    web_lines = json_lines(stack.web)
    not_found = [line for line in web_lines if line.get("request_id") == "e2e-ops-1"]
    assert not_found, "the 404 was not logged with its request id"
    assert all(line["run_id"] == str(missing) for line in not_found)


def test_readyz_goes_503_naming_redis_while_it_is_stopped_and_back_to_200_R_OPS_1(ops_stack):
    stack, redis_server = ops_stack
    with stack.client() as client:
        ready = client.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["down"] == [] and ready.json()["checks"]["worker"]["ok"]
        assert client.get("/healthz").json() == {"status": "ok"}

        redis_server.stop()
        try:
            time.sleep(1.1)  # a probe's result is reused for a second
            began = time.monotonic()
            down = client.get("/readyz")
            assert time.monotonic() - began < 10  # bounded, whatever is down
            assert down.status_code == 503, down.text
            assert down.json()["status"] == "unavailable"
            assert down.json()["down"] == ["redis", "worker"]
            assert client.get("/healthz").status_code == 200  # alive all the same
        finally:
            redis_server.start()

        deadline = time.monotonic() + 90
        while True:
            again = client.get("/readyz")
            if again.status_code == 200:
                break
            assert time.monotonic() < deadline, f"/readyz stayed {again.status_code}: {again.text}"
            time.sleep(1)
        assert again.json()["down"] == []
