"""A private stack to break on purpose (SPEC §6, R-RUN-9, R-RUN-10).

:class:`PrivatePostgres` (``initdb`` into a temporary folder, a free port,
run as the ``postgres`` user when the tests run as root) and
:class:`PrivateRedis` (``redis-server`` on a free port, no persistence)
belong to the fault tests alone, so a test may kill, stop or freeze them;
the shared PostgreSQL and Redis are never touched. :class:`FaultStack`
starts the real processes on them — replay model server, uvicorn, Celery
run workers, the maintenance worker (dispatcher and sweeper, with beat) —
with short leases, grace and intervals (:data:`FAST_SETTINGS`) so the
whole suite fits in a few minutes. :class:`Batch` submits turns over HTTP
and remembers what was accepted, for :mod:`tests.faults.invariants`.

Other fault tests (a model outage, …) reuse all of this: start the stack
with :func:`fault_stack`, submit a :class:`Batch`, inject the fault, call
:func:`settle` and :func:`tests.faults.invariants.check`, print
:func:`figures`.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg
import pytest

from tests.e2e.stack import ARTIFACTS, REPO, PrivateRedis, Process, free_port, require_redis_server, start, start_web

# The newest PostgreSQL server binaries of a Debian-like system (initdb,
# pg_ctl); None where there are none, and then the fault tests skip, saying
# why (require_private_servers), instead of failing the suite's collection.
_PG_BINS = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]))
PG_BIN = Path(_PG_BINS[-1]) if _PG_BINS else None


def require_private_servers() -> None:
    """Skip the calling test unless this machine can start a private
    PostgreSQL (``initdb`` and ``pg_ctl`` under ``/usr/lib/postgresql/*/bin``)
    and a private ``redis-server`` (on the PATH)."""
    if PG_BIN is None or not (PG_BIN / "initdb").exists():
        pytest.skip(
            "the fault tests need PostgreSQL's server binaries under /usr/lib/postgresql/*/bin (initdb, pg_ctl)"
        )
    require_redis_server()


# Short leases and intervals: recovery within seconds, not minutes.
FAST_SETTINGS = {
    "LEASE_TTL_SECONDS": "8",
    "LEASE_SWEEP_INTERVAL_SECONDS": "0.5",
    "DISPATCH_GRACE_SECONDS": "2",
    "DISPATCH_INTERVAL_SECONDS": "0.5",
    "WORKER_LOCK_TIMEOUT_MS": "6000",
    "WORKER_STATEMENT_TIMEOUT_MS": "10000",
    "WORKER_IDLE_IN_TRANSACTION_TIMEOUT_MS": "2000",
    "WEB_LOCK_TIMEOUT_MS": "500",
    "DB_POOL_TIMEOUT_SECONDS": "3",
    "AUDIT_WRITE_ATTEMPTS": "3",
    # These fault tests check how a run ends when its worker or database is
    # lost (R-RUN-7..14); test_recovery_faults runs the sweeper with the
    # default, resume, and checks that such runs are continued (R-RUN-15).
    "RUN_RECOVERY": "fail",
}


def _as_postgres(args: list[str]) -> list[str]:
    """Run a PostgreSQL binary as the ``postgres`` user when we are root
    (PostgreSQL refuses to run as root)."""
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *args]
    return args


class PrivatePostgres:
    """A PostgreSQL cluster of the test's own: ``start``, ``stop(mode)``,
    ``url(dbname)``."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.data = root / "pgdata"
        self.sockets = root / "pgsock"
        # In the cluster's own folder, which the postgres user can reach
        # wherever the checkout is (a clone in a 0700 folder); copied to
        # test-artifacts/ when the cluster stops.
        self.log = root / "postgres.log"

    def init(self) -> None:
        self.data.mkdir(parents=True)
        self.sockets.mkdir()
        if os.geteuid() == 0:
            shutil.chown(self.data, "postgres", "postgres")
            shutil.chown(self.sockets, "postgres", "postgres")
        subprocess.run(
            _as_postgres([str(PG_BIN / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8"])
            + ["--no-sync"],
            check=True,
            capture_output=True,
        )

    def start(self) -> None:
        self.log.touch()
        if os.geteuid() == 0:
            shutil.chown(self.log, "postgres", "postgres")
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.sockets} -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=300"
        )
        subprocess.run(
            _as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.log), "-w"])
            + ["start"],
            check=True,
            capture_output=True,
        )

    def stop(self, mode: str = "fast") -> None:
        subprocess.run(
            _as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"]),
            check=False,
            capture_output=True,
        )
        ARTIFACTS.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):
            shutil.copyfile(self.log, ARTIFACTS / f"private-postgres-{self.port}.log")

    def url(self, dbname: str = "postgres") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{dbname}"

    def connect(self, dbname: str = "yuxi", **kwargs) -> psycopg.Connection:
        return psycopg.connect(self.url(dbname), autocommit=True, connect_timeout=5, **kwargs)


@dataclass
class FaultStack:
    """The private stack: infrastructure, processes, users and their tokens."""

    root: Path
    pg: PrivatePostgres
    redis: PrivateRedis
    env: dict[str, str]
    base_url: str = ""
    replay: Process | None = None
    web: Process | None = None
    workers: list[Process] = field(default_factory=list)
    maintenance: Process | None = None  # dispatcher + sweeper worker, with beat (-B)
    tokens: dict[str, str] = field(default_factory=dict)  # username -> token
    staff_token: str = ""

    # -- processes ---------------------------------------------------------

    def _celery(self, name: str, args: list[str]) -> Process:
        return start(name, [sys.executable, "-m", "celery", "-A", "yuxi_project", *args], self.env)

    def launch_worker(self, name: str | None = None, concurrency: int = 2) -> Process:
        """Start a run worker on the runs queue (prefork); not waited for."""
        name = name or f"fault-worker-{uuid.uuid4().hex[:6]}"
        worker = self._celery(
            name,
            ["worker", "-Q", self.env["CELERY_QUEUE"], "-n", f"{name}@%h", "--pool=prefork"]
            # No step switched off on the command line, as in a deployment:
            # the broker-loss tests must meet what a real worker meets (the
            # product's consumer, yuxi_project.broker.Consumer, keeps Mingle
            # and Gossip from starting itself).
            + [f"--concurrency={concurrency}", "-l", "info"],
        )
        # Its pool's processes, each with one worker loop that may keep its
        # last run's checkpointer connection for the next run.
        worker.concurrency = concurrency
        return worker

    def start_worker(self, name: str | None = None, concurrency: int = 2) -> Process:
        """A run worker on the runs queue, ready."""
        worker = self.launch_worker(name, concurrency)
        worker.wait_for_line(" ready.", timeout=180)
        self.workers.append(worker)
        return worker

    def launch_maintenance(self) -> Process:
        """The maintenance worker: dispatcher and sweeper on their own queue,
        with beat in the same process (``-B``); not waited for."""
        name = f"fault-maintenance-{uuid.uuid4().hex[:4]}"
        return self._celery(
            name,
            ["worker", "-B", "-Q", self.env["CELERY_MAINTENANCE_QUEUE"], "-n", f"{name}@%h", "--pool=solo"]
            + ["-l", "info", "--without-gossip", "--without-mingle", "--without-heartbeat"],
        )

    def start_maintenance(self) -> None:
        self.maintenance = self.launch_maintenance()
        self.maintenance.wait_for_line(" ready.", timeout=180)

    def start_web(self) -> None:
        port = free_port()
        self.web = start_web(f"fault-web-{port}", port, self.env)
        self.base_url = f"http://127.0.0.1:{port}"

    def processes(self) -> list[Process]:
        return [p for p in [*self.workers, self.maintenance, self.web, self.replay] if p is not None]

    def ensure_running(self, workers: int = 2) -> None:
        """Restart whatever a previous test killed or froze, so each test
        starts from a healthy stack."""
        for process in self.processes():
            with contextlib.suppress(OSError):
                os.killpg(process.popen.pid, signal.SIGCONT)
        if self.redis.process is None or self.redis.process.poll() is not None:
            self.redis.start()
        try:
            self.pg.connect("postgres").close()
        except psycopg.Error:
            self.pg.start()
        self.workers = [w for w in self.workers if w.popen.poll() is None]
        while len(self.workers) < workers:
            self.start_worker()
        if self.web is None or self.web.popen.poll() is not None:
            self.start_web()
        if self.maintenance is None or self.maintenance.popen.poll() is not None:
            self.start_maintenance()

    def stop(self) -> None:
        for process in self.processes():
            with contextlib.suppress(OSError):
                os.killpg(process.popen.pid, signal.SIGCONT)
            process.stop()
        self.redis.kill9()
        self.pg.stop("immediate")
        # The cluster's log is in test-artifacts/ by now; its data directory
        # and workspaces (tens of MB) would otherwise stay in /tmp per run.
        shutil.rmtree(self.root, ignore_errors=True)

    # -- HTTP ---------------------------------------------------------------

    def client(self, username: str | None = None, timeout: float = 30) -> httpx.Client:
        token = self.tokens[username] if username else self.staff_token
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout)

    def db(self) -> psycopg.Connection:
        return self.pg.connect("yuxi")


def _manage(env: dict[str, str], *args: str, stdin: str | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=REPO, env=env, input=stdin, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def _migrations_digest() -> str:
    digest = hashlib.sha256(str(PG_BIN).encode())
    for path in sorted(REPO.glob("*/migrations/*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def _migrated_template(env_base: dict[str, str]) -> Path:
    """A PostgreSQL data folder with database ``yuxi`` migrated, built once
    per set of migrations and copied for each session (migrating takes far
    longer than copying)."""
    template = Path(tempfile.gettempdir()) / f"yuxi-faults-pgdata-{_migrations_digest()}"
    if (template / "PG_VERSION").exists():
        return template
    build = Path(tempfile.mkdtemp(prefix="yuxi-faults-build-"))
    build.chmod(0o755)
    pg = PrivatePostgres(build)
    pg.init()
    pg.start()
    try:
        with pg.connect("postgres") as conn:
            conn.execute("CREATE DATABASE yuxi")
        _manage({**env_base, "DATABASE_URL": pg.url("yuxi")}, "migrate", "--noinput")
    finally:
        pg.stop("fast")
    with contextlib.suppress(OSError):
        os.rename(pg.data, template)  # another session may have won: fine
    shutil.rmtree(build, ignore_errors=True)
    return template


def _create_users(pg: PrivatePostgres, names: list[str]) -> dict[str, str]:
    """Users with unusable passwords and one API token each (``staff`` is
    staff); returns ``{username: token}``."""
    from conversations.models import ApiToken

    tokens = {}
    with pg.connect("yuxi") as conn:
        for name in names:
            staff = name == "staff"
            user_id = conn.execute(
                "INSERT INTO auth_user (password, is_superuser, username, first_name, last_name, email, is_staff,"
                " is_active, date_joined) VALUES ('!', %s, %s, '', '', '', %s, true, now()) RETURNING id",
                [staff, name, staff],
            ).fetchone()[0]
            plaintext = "yx_" + secrets.token_urlsafe(32)
            conn.execute(
                "INSERT INTO conversations_apitoken (user_id, name, prefix, key_digest, created_at)"
                " VALUES (%s, 'faults', %s, %s, now())",
                [user_id, plaintext[:10], ApiToken.digest(plaintext)],
            )
            tokens[name] = plaintext
    return tokens


def fault_stack(users: int = 6, workers: int = 2) -> FaultStack:
    """Create the private PostgreSQL (from a migrated template) and Redis,
    ``users`` users (``user0``…) and a staff user with tokens, and start
    every process at once. The caller stops it with :meth:`FaultStack.stop`.
    Skips the caller where the private servers cannot start
    (:func:`require_private_servers`)."""
    require_private_servers()
    root = Path(tempfile.mkdtemp(prefix="yuxi-faults-"))
    root.chmod(0o755)
    replay_port = free_port()
    env = {
        **os.environ,
        "CELERY_QUEUE": f"faults-{uuid.uuid4().hex[:6]}",
        "CELERY_MAINTENANCE_QUEUE": f"faults-maintenance-{uuid.uuid4().hex[:6]}",
        "REPLAY_MODEL_URL": f"http://127.0.0.1:{replay_port}/v1",
        "WORKSPACE_ROOT": str(root / "workspaces"),
        "PYTHONUNBUFFERED": "1",
        "PYTHONWARNINGS": "ignore",
        **FAST_SETTINGS,
    }
    template = _migrated_template(env)
    pg, redis_server = PrivatePostgres(root), PrivateRedis()
    subprocess.run(["cp", "-a", str(template), str(pg.data)], check=True)
    pg.sockets.mkdir()
    if os.geteuid() == 0:
        shutil.chown(pg.sockets, "postgres", "postgres")
    pg.start()
    redis_server.start()
    env.update({"DATABASE_URL": pg.url("yuxi"), "REDIS_URL": redis_server.url})
    stack = FaultStack(root=root, pg=pg, redis=redis_server, env=env)
    try:
        tokens = _create_users(pg, [f"user{i}" for i in range(users)] + ["staff"])
        stack.staff_token = tokens.pop("staff")
        stack.tokens = tokens
        # Start everything, then wait: the imports dominate start-up.
        stack.replay = start(
            "fault-replay", [sys.executable, "manage.py", "replay_model_server", "--port", str(replay_port)], env
        )
        web_port = free_port()
        web = start(
            f"fault-web-{web_port}",
            [sys.executable, "-m", "uvicorn", "yuxi_project.asgi:application", "--host", "127.0.0.1"]
            + ["--port", str(web_port), "--no-access-log"],
            env,
        )
        stack.web, stack.base_url = web, f"http://127.0.0.1:{web_port}"
        stack.maintenance = stack.launch_maintenance()
        launched = [stack.launch_worker() for _ in range(workers)]
        stack.replay.wait_for_line("replay model server listening", timeout=180)
        web.wait_for_line("Uvicorn running", timeout=180)
        stack.maintenance.wait_for_line(" ready.", timeout=180)
        for worker in launched:
            worker.wait_for_line(" ready.", timeout=180)
            stack.workers.append(worker)
        warm_up(stack)
    except Exception:
        stack.stop()
        raise
    return stack


# --------------------------------------------------------------------------
# Turns
# --------------------------------------------------------------------------


@dataclass
class Turn:
    username: str
    thread_id: str
    request_id: str
    status_code: int | None = None
    run_id: str | None = None


@dataclass
class Batch:
    """Turns submitted over HTTP, and the threads they went to."""

    stack: FaultStack
    turns: list[Turn] = field(default_factory=list)
    threads: dict[str, str] = field(default_factory=dict)  # thread id -> username

    def new_thread(self, username: str, model: str = "replay:plain_answer") -> str:
        with self.stack.client(username) as client:
            response = client.post("/api/threads", json={"agent_id": "assistant", "model": model})
        assert response.status_code == 201, response.text
        thread_id = response.json()["thread_id"]
        self.threads[thread_id] = username
        return thread_id

    def submit(self, thread_id: str, text: str = "hello", request_id: str | None = None, timeout: float = 30) -> Turn:
        """``POST /api/threads/{id}/runs``; the turn is remembered whatever
        the answer (a 5xx is a finding, a transport error too)."""
        username = self.threads[thread_id]
        turn = Turn(username, thread_id, request_id or uuid.uuid4().hex)
        self.turns.append(turn)
        try:
            with self.stack.client(username, timeout=timeout) as client:
                response = client.post(
                    f"/api/threads/{thread_id}/runs", json={"request_id": turn.request_id, "input": {"text": text}}
                )
            turn.status_code = response.status_code
            if response.status_code in (200, 202):
                turn.run_id = response.json()["run_id"]
        except httpx.HTTPError:
            turn.status_code = None
        return turn

    def spread(self, threads: int, turns_per_thread: int, models: list[str] | None = None) -> None:
        """Create ``threads`` threads over the users and submit
        ``turns_per_thread`` turns to each, interleaved."""
        models = models or ["replay:plain_answer", "replay:tool_then_answer"]
        users = sorted(self.stack.tokens)
        created = [self.new_thread(users[i % len(users)], models[i % len(models)]) for i in range(threads)]
        for n in range(turns_per_thread):
            for thread_id in created:
                self.submit(thread_id, text=f"turn {n}")


def warm_up(stack: FaultStack) -> None:
    """One turn per worker slot before any fault: a fresh pool process's
    first run pays for building the agent, which a loaded machine can
    stretch past a short lease."""
    batch = Batch(stack)
    slots = 2 * len(stack.workers)
    threads = [batch.new_thread(sorted(stack.tokens)[i % len(stack.tokens)]) for i in range(slots)]
    for thread_id in threads:
        batch.submit(thread_id, "warm up")
    settle(stack, batch, timeout=180)


def run_rows(stack: FaultStack) -> list[dict]:
    with stack.db() as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        cur.execute("SELECT id, request_id, thread_id, status, error_type, fencing_token FROM audit_agentrun")
        return cur.fetchall()


def settle(stack: FaultStack, batch: Batch, timeout: float = 60) -> float:
    """Wait until every run of the batch's threads is terminal; returns the
    seconds it took. Raises TimeoutError naming the runs still open."""
    began = time.monotonic()
    threads = list(batch.threads)
    while True:
        try:
            with stack.db() as conn:
                open_runs = conn.execute(
                    "SELECT id::text, status FROM audit_agentrun WHERE thread_id = ANY(%s::uuid[]) "
                    "AND status IN ('pending', 'running', 'cancel_requested')",
                    [threads],
                ).fetchall()
        except psycopg.OperationalError:
            open_runs = [("database", "unreachable")]
        if not open_runs:
            return time.monotonic() - began
        if time.monotonic() - began > timeout:
            raise TimeoutError(f"{len(open_runs)} run(s) still open after {timeout}s: {open_runs[:10]}")
        time.sleep(0.25)


def new_turn_on_each_thread(stack: FaultStack, batch: Batch, timeout: float = 60) -> list[str]:
    """Submit one more turn on every thread of the batch and wait for each
    to complete; returns the problems (an empty list when all completed)."""
    fresh = [batch.submit(thread_id, text="after the fault") for thread_id in list(batch.threads)]
    problems = [f"new turn on {t.thread_id}: HTTP {t.status_code}" for t in fresh if t.status_code != 202]
    settle(stack, batch, timeout=timeout)
    with stack.db() as conn:
        for turn in fresh:
            if turn.run_id is None:
                continue
            status = conn.execute("SELECT status FROM audit_agentrun WHERE id = %s", [turn.run_id]).fetchone()[0]
            if status != "completed":
                problems.append(f"new turn on thread {turn.thread_id} ended {status}")
    return problems


def figures(name: str, stack: FaultStack, batch: Batch, *, violations: list[str], recovery_seconds: float) -> dict:
    """Print and return the figures of one fault: runs, outcomes, lost,
    violations, recovery seconds."""
    rows = [r for r in run_rows(stack) if str(r["thread_id"]) in batch.threads]
    outcomes = Counter(f"{r['status']}:{r['error_type']}" if r["error_type"] else r["status"] for r in rows)
    accepted = {t.request_id for t in batch.turns if t.status_code in (200, 202)}
    stored = {r["request_id"] for r in rows}
    lost = len(accepted - stored)
    result = {
        "fault": name,
        "submitted": len(batch.turns),
        "accepted": len(accepted),
        "runs": len(rows),
        "outcomes": dict(sorted(outcomes.items())),
        "lost": lost,
        "stuck": sum(1 for r in rows if r["status"] in ("pending", "running", "cancel_requested")),
        "violations": len(violations),
        "recovery_seconds": round(recovery_seconds, 1),
    }
    print(f"\nFAULT FIGURES {json.dumps(result)}")
    for violation in violations:
        print(f"  violation: {violation}")
    return result
