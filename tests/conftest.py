"""Shared fixtures. Tests run against real PostgreSQL and Redis (see
``bin/test``); nothing the project owns is mocked."""

from __future__ import annotations

import json
import os
import secrets
import uuid

import pytest
from django.conf import settings
from django.db import connection

from audit import ledger
from audit.ledger.lease import Lease
from conversations.models import ApiToken, Conversation, Message
from tests.waiting import WAIT_SECONDS


def pytest_configure(config):
    engine = settings.DATABASES["default"]["ENGINE"]
    if "postgresql" not in engine:
        raise pytest.UsageError(
            "the tests need PostgreSQL: set DATABASE_URL=postgres://... (bin/test does this); "
            f"the configured engine is {engine}"
        )
    if not settings.CONFIG.REDIS_URL:
        raise pytest.UsageError("the tests need Redis: set REDIS_URL=redis://... (bin/test does this)")
    # Test users need no password strength: see tests/hashers.py.
    settings.PASSWORD_HASHERS = ["tests.hashers.OneIterationPBKDF2PasswordHasher"]
    # The web servers and workers the tests start refuse the public default
    # key with DEBUG off (R-SEC-1); bin/test sets one, pytest run alone too.
    os.environ.setdefault("SECRET_KEY", "test-" + secrets.token_hex(32))
    _flush_retrying_deadlocks()


def _flush_retrying_deadlocks() -> None:
    """A transactional test ends with a flush (one TRUNCATE of every
    table, locked in no fixed order) while the stack of an end-to-end or
    browser module may still be at work on the same database (a worker's
    sweep, a page's last request): a statement holding one table and
    reading another deadlocked with it, and the test errored at teardown.
    PostgreSQL undoes the whole TRUNCATE then; it is tried again."""
    import time

    from django.db import OperationalError
    from django.db.backends.postgresql.operations import DatabaseOperations

    flush = DatabaseOperations.execute_sql_flush

    def execute_sql_flush(self, sql_list):
        for attempt in range(5):
            try:
                return flush(self, sql_list)
            except OperationalError as exc:
                if getattr(exc.__cause__, "sqlstate", None) != "40P01" or attempt == 4:  # deadlock_detected
                    raise
                time.sleep(0.2 * (attempt + 1))

    DatabaseOperations.execute_sql_flush = execute_sql_flush


@pytest.fixture(autouse=True)
def _no_kept_checkpointer_connection():
    """A run on this thread's worker loop leaves its checkpointer connection
    and its awaited-write connection for the next run
    (audit.execution.checkpoint.open_checkpointer, core.db.AwaitedConnections):
    each test starts and ends without them, so that tests counting
    connections see their own runs' only and the test database can be
    dropped at the end."""
    from audit.execution.worker_loop import close_kept_connections

    close_kept_connections()
    yield
    close_kept_connections()


@pytest.fixture
def user(django_user_model):
    return django_user_model.objects.create_user(username=f"user-{uuid.uuid4().hex[:8]}", password="pw-12345678")


@pytest.fixture
def other_user(django_user_model):
    return django_user_model.objects.create_user(username=f"other-{uuid.uuid4().hex[:8]}", password="pw-12345678")


@pytest.fixture
def staff_user(django_user_model):
    return django_user_model.objects.create_user(
        username=f"staff-{uuid.uuid4().hex[:8]}", password="pw-12345678", is_staff=True, is_superuser=True
    )


def bearer(user) -> dict[str, str]:
    """Headers with a fresh API token of ``user``."""
    _, plaintext = ApiToken.objects.issue(user=user, name="test")
    return {"Authorization": f"Bearer {plaintext}"}


@pytest.fixture
def thread(user):
    return Conversation.objects.create(user=user, agent_id="assistant", model="replay:tool_then_answer")


def make_run(thread, *, text: str = "weather in Paris?", request_id: str | None = None):
    """Submit a turn through the service. In a test wrapped in a transaction
    nothing is enqueued (enqueueing happens on commit); the test drives the
    worker side itself."""
    return ledger.run_submit(
        user=thread.user, thread_id=thread.id, request_id=request_id or uuid.uuid4().hex, text=text
    )[0]


def resume_row_of(run, *, decisions: list | None = None):
    """A resume run of ``run`` (interrupted) created as a row, as the resume
    service would, without the service's checks: for tests that need one
    in a state the service would refuse to make."""
    from audit.models import AgentRun

    return AgentRun.objects.create(
        request_id=uuid.uuid4().hex,
        thread=run.thread,
        user=run.thread.user,
        agent_id="assistant",
        model=run.thread.model,
        input={"decisions": decisions or [{"type": "approve"}]},
        resumed_from=run,
        turn_id=run.turn_id,
    )


def acquire(run, *, owner: str = "worker-a", ttl: float = 60.0) -> Lease:
    return ledger.run_acquire(run_id=run.id, owner=owner, ttl_seconds=ttl)


def prepared_executions(pattern: str) -> dict[str, int]:
    """This connection's prepared statements whose text is ``LIKE pattern``:
    name -> times executed. Prepared statements bypass Django's query
    counting; tests of hot statements count them here."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT name, generic_plans + custom_plans FROM pg_prepared_statements WHERE statement LIKE %s", [pattern]
        )
        return dict(cursor.fetchall())


def prepared_executed_since(before: dict[str, int], pattern: str) -> list[int]:
    """How many times each prepared statement ``LIKE pattern`` ran since
    ``before`` (:func:`prepared_executions`), sorted; unchanged ones left out."""
    after = prepared_executions(pattern)
    return sorted(n - before.get(name, 0) for name, n in after.items() if n != before.get(name, 0))


@pytest.fixture
def recovery_fail(monkeypatch):
    """``RUN_RECOVERY=fail``: the lease sweeper ends an expired run
    ``failed`` / ``lease_expired`` (R-RUN-7) instead of continuing it as
    its next attempt (the default, R-RUN-15). For tests of that end."""
    from core.config import get_config

    monkeypatch.setattr(get_config(), "RUN_RECOVERY", "fail")


@pytest.fixture
def db_name():
    return connection.settings_dict["NAME"]


def replay_server_in_thread(scenarios, name: str = "replay-model-server"):
    """Serve ``scenarios`` (``load_scenarios(...)``) with a replay model
    server in a thread of the test process; a context manager that yields
    its base URL and stops it at the end."""
    from audit.replay.server import serving_in_thread

    return serving_in_thread(scenarios, name=name)


@pytest.fixture(scope="session")
def replay_server_url():
    """A replay model server for the whole session, in a thread of the test
    process (in-process runner tests); e2e tests start their own process."""
    from audit.replay.scenarios import load_scenarios

    with replay_server_in_thread(load_scenarios()) as url:
        yield url


@pytest.fixture
def replay_models(replay_server_url, monkeypatch):
    """Point ``replay:<scenario>`` models of this process at the replay server."""
    from core.config import get_config

    monkeypatch.setattr(get_config(), "REPLAY_MODEL_URL", replay_server_url)
    return replay_server_url


def run_in_a_thread(user, owner: str | None, *, model: str, until) -> tuple:
    """A run of ``model`` on a new thread of ``user``, executed by ``owner``
    (``run_execute``) in a thread, returned once ``until(run)`` holds:
    (run, the thread, its result dict with ``status`` once it ends)."""
    import threading
    import time

    from audit.execution.runner import run_execute

    thread = Conversation.objects.create(user=user, agent_id="assistant", model=model)
    run = make_run(thread)
    result: dict = {}

    def work():
        try:
            result["status"] = run_execute(run_id=run.id, owner=owner)
        finally:
            connection.close()

    worker = threading.Thread(target=work)
    worker.start()
    deadline = time.monotonic() + WAIT_SECONDS
    while not until(run):
        assert time.monotonic() < deadline and worker.is_alive(), result
        time.sleep(0.02)
    return run, worker, result


def run_answering(user, *, model: str = "replay:long_answer") -> tuple:
    """A run of ``model`` (by default the two-minute long answer) on a new
    thread of ``user``, executed in a thread and returned once it is
    running with its model row open: (run, the thread, its result dict)."""
    from audit.models import AgentRun

    def answering(run) -> bool:
        return (
            AgentRun.objects.get(pk=run.pk).status == "running"
            and Message.objects.filter(run=run, role="assistant").exists()
        )

    return run_in_a_thread(user, "in-process", model=model, until=answering)


def sent_requests(monkeypatch) -> list[list[dict]]:
    """The messages of every chat request the replay model server receives
    (it runs in a thread of this process), in order."""
    from audit.replay import server

    received: list[list[dict]] = []
    turn_index = server.turn_index

    def recording(messages):
        received.append(json.loads(json.dumps(messages)))
        return turn_index(messages)

    monkeypatch.setattr(server, "turn_index", recording)
    return received
