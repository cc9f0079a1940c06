"""The quick start's embedded PostgreSQL (bin/pg_embedded.py): where no
PostgreSQL server is reachable, the product runs on a server of its own,
with every migration (found by a newcomer: the embedded fallback stopped
at the first PostgreSQL-only migration)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bin" / "pg_embedded.py"

pytestmark = pytest.mark.slow


def _run(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_the_embedded_server_starts_migrates_and_stops(tmp_path):
    data = tmp_path / "pgdata"
    started = _run(str(SCRIPT), "start", str(data), "yuxi_embedded")
    assert started.returncode == 0, started.stderr
    url = started.stdout.strip().splitlines()[-1]
    try:
        assert url.startswith("postgres://postgres@%2F") and url.endswith("/yuxi_embedded")
        # Started again: the same server and database, no error.
        again = _run(str(SCRIPT), "start", str(data), "yuxi_embedded")
        assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == url, again.stderr
        env = {**os.environ, "DATABASE_URL": url, "REDIS_URL": ""}
        migrated = _run("manage.py", "migrate", "--noinput", env=env)
        assert migrated.returncode == 0, migrated.stdout[-2000:] + migrated.stderr[-2000:]
        with psycopg.connect(url) as conn:
            applied = conn.execute("SELECT count(*) FROM django_migrations WHERE app = 'dashboard'").fetchone()[0]
        assert applied >= 2
    finally:
        stopped = _run(str(SCRIPT), "stop", str(data))
    assert stopped.returncode == 0, stopped.stderr
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(url, connect_timeout=3).close()


def test_stop_without_a_server_is_no_error(tmp_path):
    stopped = _run(str(SCRIPT), "stop", str(tmp_path / "never-started"))
    assert stopped.returncode == 0, stopped.stderr


def test_bad_arguments_print_the_usage():
    result = _run(str(SCRIPT), "start")
    assert result.returncode == 2 and "pg_embedded.py start" in result.stderr


def _quickstart_env(tmp_path) -> dict[str, str]:
    """The README's embedded defaults chosen on purpose (both URLs empty),
    on free ports, with logs and data in ``tmp_path``."""
    from tests.e2e.stack import free_port

    return {
        **os.environ,
        "DATABASE_URL": "",
        "REDIS_URL": "",
        "PORT": str(free_port()),
        "REPLAY_PORT": str(free_port()),
        "LOG_DIR": str(tmp_path / "log"),
        "EMBEDDED_PGDATA": str(tmp_path / "pgdata"),
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prometheus"),
    }


def _server_starts(data: Path) -> int:
    """How many times a server started on ``data`` (its log)."""
    log = data / "log"
    return log.read_text(errors="replace").count("ready to accept connections") if log.exists() else 0


@pytest.mark.e2e
def test_the_quick_start_runs_its_demo_without_postgresql_and_redis(tmp_path):
    """``DATABASE_URL= REDIS_URL= bin/quickstart --once``: an embedded
    PostgreSQL, the in-process worker, the demo turns end as the README
    shows, and the embedded server is stopped at the end, once."""
    env = _quickstart_env(tmp_path)
    result = subprocess.run(
        ["bin/quickstart", "--once"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "DATABASE_URL is empty: starting an EMBEDDED PostgreSQL" in output
    assert "REDIS_URL is empty: EMBEDDED worker" in output
    statuses = [line.split()[3] for line in result.stdout.splitlines() if line.strip().startswith("replay:")]
    assert statuses == ["completed", "completed", "completed", "interrupted"], output[-4000:]
    assert "and the embedded PostgreSQL, have STOPPED" in output
    data = Path(env["EMBEDDED_PGDATA"])
    assert not (data / "postmaster.pid").exists()
    assert _server_starts(data) == 1


@pytest.mark.e2e
def test_ctrl_c_stops_the_quick_start_and_its_embedded_server_once(tmp_path):
    """Ctrl-C while it serves: everything stops, and the embedded server is
    not started again on the way out (found by a newcomer: the exit trap
    ran the clean-up a second time, and stopping a stopped data directory
    started its server first)."""
    import signal
    import time

    env = _quickstart_env(tmp_path)
    log = tmp_path / "quickstart.log"
    with log.open("w") as out:
        # Ctrl-C as a terminal sends it, to a quick start whose SIGINT has
        # its default action: one started from a run in the background of a
        # non-interactive shell inherits it ignored, and bash cannot trap a
        # signal ignored on entry (GNU env resets it).
        process = subprocess.Popen(
            ["env", "--default-signal=INT", "bin/quickstart"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 300
        while "Serving on" not in log.read_text() and time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()[-4000:]
            time.sleep(0.5)
        assert "Serving on" in log.read_text(), log.read_text()[-4000:]
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    data = Path(env["EMBEDDED_PGDATA"])
    assert not (data / "postmaster.pid").exists(), log.read_text()[-4000:]
    assert "==> stopped (the embedded PostgreSQL too" in log.read_text(), log.read_text()[-2000:]
    assert _server_starts(data) == 1, (data / "log").read_text()[-3000:]
    # Stopping a stopped data directory starts nothing either.
    assert _run(str(SCRIPT), "stop", str(data)).returncode == 0
    assert _server_starts(data) == 1 and not (data / "postmaster.pid").exists()
