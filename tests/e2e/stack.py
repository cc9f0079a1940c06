"""Real processes for end-to-end tests: the replay model server, a Celery
worker and the ASGI web server (uvicorn), all on the test database and a
Redis queue of their own. Logs go to ``test-artifacts/``."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.waiting import WAIT_SECONDS

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"


_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on, for a process a
    test starts. It is drawn below the kernel's ephemeral range, so no
    outgoing connection takes it between this call and the process's
    bind, and never handed out twice in one test session (two calls in a
    row could otherwise return the same just-freed port)."""
    low = max(_ephemeral_low(), 11000)
    rng = random.SystemRandom()
    with _handed_out_lock:
        for _ in range(1000):
            port = rng.randrange(10000, low)
            if port in _handed_out:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    raise RuntimeError("no free TCP port below the ephemeral range")


class PrivateRedis:
    """A ``redis-server`` of a test's own on a free port, without
    persistence: stopping or killing it never touches the shared Redis, and
    :meth:`start` after :meth:`kill9` brings it back empty on the same port.
    :meth:`start` skips the calling test where ``redis-server`` is not on
    the PATH."""

    def __init__(self):
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        require_redis_server()
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # no signal meant for the test run reaches it
        )
        import redis

        deadline = time.monotonic() + WAIT_SECONDS
        while time.monotonic() < deadline:
            try:
                redis.Redis(port=self.port, socket_connect_timeout=0.5).ping()
                return
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError("private redis-server did not start")

    def stop(self) -> None:
        """Stop it (SIGTERM) and wait."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None

    def kill9(self) -> None:
        """Kill it (SIGKILL): every message it held is lost."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=5)


def require_redis_server() -> None:
    """Skip the calling test unless ``redis-server`` is on the PATH."""
    if shutil.which("redis-server") is None:
        pytest.skip("this test needs redis-server on the PATH")


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log_path: Path
    _lines: list[str] = field(default_factory=list)

    def output(self) -> str:
        return "".join(self._lines)

    def wait_for_line(self, needle: str, timeout: float = WAIT_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(needle in line for line in self._lines):
                return
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.popen.returncode}):\n{self.output()[-4000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} did not print {needle!r} in {timeout}s:\n{self.output()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=5)

    def kill(self) -> None:
        """SIGKILL the whole process group (a crashed worker)."""
        self.stop(signal.SIGKILL)


def start(name: str, args: list[str], env: dict[str, str]) -> Process:
    ARTIFACTS.mkdir(exist_ok=True)
    log_path = ARTIFACTS / f"{name}.log"
    popen = subprocess.Popen(
        args,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    process = Process(name, popen, log_path)

    def pump() -> None:
        with open(log_path, "a") as log:
            for line in popen.stdout:
                process._lines.append(line)
                log.write(line)
                log.flush()

    threading.Thread(target=pump, daemon=True, name=f"log-{name}").start()
    return process


def start_web(name: str, port: int, env: dict[str, str]) -> Process:
    """The ASGI web server (uvicorn) on ``127.0.0.1:port``, ready to serve."""
    web = start(
        name,
        [
            sys.executable,
            "-m",
            "uvicorn",
            "yuxi_project.asgi:application",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-access-log",
        ],
        env,
    )
    try:
        web.wait_for_line("Uvicorn running")
    except Exception:
        web.stop()
        raise
    return web


def database_url_of(settings_dict: dict) -> str:
    """``postgres://`` URL of a Django database (the test database, for
    the processes a test starts)."""
    user = settings_dict.get("USER") or ""
    password = f":{settings_dict['PASSWORD']}" if settings_dict.get("PASSWORD") else ""
    auth = f"{user}{password}@" if user else ""
    host = settings_dict.get("HOST") or "127.0.0.1"
    port = settings_dict.get("PORT") or 5432
    return f"postgres://{auth}{host}:{port}/{settings_dict['NAME']}"


@dataclass
class Stack:
    """The running processes and how to reach them."""

    env: dict[str, str]
    base_url: str
    replay: Process
    web: Process
    workers: list[Process]

    def client(self, headers: dict[str, str] | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=headers or {}, timeout=30)

    def start_worker(
        self, name: str | None = None, concurrency: int = 2, beat: bool = True, env: dict[str, str] | None = None
    ) -> Process:
        """Start a Celery worker on the stack's queue. With ``beat`` it also
        runs the beat scheduler in-process (``-B``), which schedules the
        lease sweeper (R-RUN-7); several beats are harmless. ``env``
        overrides the stack's environment for this worker only."""
        name = name or f"worker-{len(self.workers) + 1}"
        # With beat, this worker also serves the maintenance queue (the
        # dispatcher and the sweeper, R-RUN-9, R-RUN-7) and, when the stack
        # names one, the webhook queue (R-API-3).
        beat_args = ["-B"] if beat else []
        queues = (
            ",".join(
                filter(
                    None,
                    [self.env["CELERY_QUEUE"], self.env["CELERY_MAINTENANCE_QUEUE"], self.env.get("WEBHOOK_QUEUE")],
                )
            )
            if beat
            else self.env["CELERY_QUEUE"]
        )
        worker = start(
            name,
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "yuxi_project",
                "worker",
                "-Q",
                queues,
                "-n",
                f"{name}-{uuid.uuid4().hex[:6]}@%h",
                "--pool=prefork",
                f"--concurrency={concurrency}",
                "-l",
                "info",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                *beat_args,
            ],
            {**self.env, **(env or {})},
        )
        worker.wait_for_line(" ready.")
        self.workers.append(worker)
        return worker

    def stop(self) -> None:
        for process in [*self.workers, self.web, self.replay]:
            process.stop()


def start_stack(
    *, database_url: str, redis_url: str, lease_ttl: float = 6.0, workers: int = 1, env: dict[str, str] | None = None
) -> Stack:
    """Start replay server, web server and ``workers`` Celery workers;
    ``env`` adds to or overrides the processes' environment."""
    replay_port, web_port = free_port(), free_port()
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "CELERY_QUEUE": f"e2e-{uuid.uuid4().hex[:8]}",
        "REPLAY_MODEL_URL": f"http://127.0.0.1:{replay_port}/v1",
        "LEASE_TTL_SECONDS": str(lease_ttl),
        "LEASE_SWEEP_INTERVAL_SECONDS": "1",
        "CELERY_MAINTENANCE_QUEUE": f"e2e-maintenance-{uuid.uuid4().hex[:8]}",
        "DISPATCH_INTERVAL_SECONDS": "1",
        "DISPATCH_GRACE_SECONDS": "5",
        "WORKSPACE_ROOT": str(ARTIFACTS / "workspaces"),
        "PYTHONUNBUFFERED": "1",
        "PYTHONWARNINGS": "ignore",
        **(env or {}),
    }
    replay = start("replay", [sys.executable, "manage.py", "replay_model_server", "--port", str(replay_port)], env)
    replay.wait_for_line("replay model server listening")
    web = start_web("web", web_port, env)
    stack = Stack(env=env, base_url=f"http://127.0.0.1:{web_port}", replay=replay, web=web, workers=[])
    try:
        for _ in range(workers):
            stack.start_worker()
    except Exception:
        stack.stop()
        raise
    return stack


def wait_for_status(client: httpx.Client, run_id: str, statuses: set[str], timeout: float = WAIT_SECONDS) -> dict:
    """Poll ``GET /api/runs/{id}`` until its status is one of ``statuses``."""
    deadline = time.monotonic() + timeout
    body: dict = {}
    while time.monotonic() < deadline:
        response = client.get(f"/api/runs/{run_id}")
        response.raise_for_status()
        body = response.json()
        if body["status"] in statuses:
            return body
        time.sleep(0.1)
    raise TimeoutError(f"run {run_id} still {body.get('status')} after {timeout}s: {body}")


TERMINAL_STATUSES = {"completed", "failed", "cancelled", "interrupted"}


def create_thread(client: httpx.Client, model: str, agent_id: str = "assistant") -> str:
    """``POST /api/threads`` with ``model``; returns the new thread id."""
    created = client.post("/api/threads", json={"agent_id": agent_id, "model": model})
    assert created.status_code == 201, created.text
    return created.json()["thread_id"]
