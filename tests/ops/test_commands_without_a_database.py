"""Every management command of the project that needs the database refuses
in one line when none is set up, and creates no SQLite file; a command that
needs none runs without one, and creates no file either."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import get_commands, load_command_class

from audit.management.commands._database import DatabaseCommand

REPO = Path(__file__).resolve().parents[2]
EMBEDDED = REPO / "var" / "yuxi.sqlite3"  # the settings' file when DATABASE_URL is unset

# Arguments that would reach the database if the command did not refuse first.
NEEDS_DATABASE = {
    "bench_audit_writes": ["--writes", "2", "--warmup", "0", "--threads", "1", "--rounds", "1"],
    "bench_dashboard": ["--rows", "1000", "--days", "1"],
    "bench_metrics": ["--models", "2", "--tools", "2", "--ended", "1", "--live", "0", "--rounds", "1"],
    "bench_otel_export": ["--runs", "1", "--rounds", "1"],
    "bench_purge": ["--runs", "1", "--rounds", "1"],
    "bench_read_paths": ["--rows", "1000", "--rounds", "1"],
    "bench_run_overhead": ["--runs", "1", "--rounds", "1", "--warmup", "0"],
    "bench_seal": [],
    "create_api_token": ["admin"],
    "demo": [],
    "erase_user": ["nobody"],
    "export_audit": ["--run", "00000000-0000-0000-0000-000000000000"],
    "export_otel": ["--once"],
    "export_scenario": ["00000000-0000-0000-0000-000000000000"],
    "performance_report": [],
    "purge_payloads": ["--older-than-days", "30", "--dry-run"],
    "publish_digest": [],
    "rebuild_rollups": [],
    "replay_run": ["00000000-0000-0000-0000-000000000000"],
    "set_budget": ["--default", "--usd", "1", "--period", "day"],
    "verify_audit": [],
}
# Commands that need no database: they skip the system checks, which open it.
NEEDS_NONE = {"config_reference": [], "replay_model_server": None}  # None: a server, not run here

PROJECT_APPS = ("audit", "benchmarks", "costs", "dashboard", "governance", "ops", "otel_export")


def _project_commands() -> dict[str, type]:
    return {name: type(load_command_class(app, name)) for name, app in get_commands().items() if app in PROJECT_APPS}


def test_every_project_command_either_refuses_without_a_database_or_needs_none():
    commands = _project_commands()
    assert set(commands) == set(NEEDS_DATABASE) | set(NEEDS_NONE), "add the new command to one of the lists"
    for name, command in commands.items():
        if name in NEEDS_DATABASE:
            assert issubclass(command, DatabaseCommand), f"{name} opens the database without require_database"
        else:
            assert command.requires_system_checks == [], f"{name}'s system checks would create a SQLite file"


def _run(name: str, args: list[str], database_url: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "manage.py", name, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "DATABASE_URL": database_url, "REDIS_URL": ""},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """Each database command run once, all at once (a Django start-up each),
    each with ``DATABASE_URL`` naming a SQLite file of its own that does not
    exist: {name: (exit status, stderr, that file)}."""
    started = {}
    for name, args in NEEDS_DATABASE.items():
        missing = tmp_path_factory.mktemp(name) / "yuxi.sqlite3"
        started[name] = (_run(name, args, f"sqlite:///{missing}"), missing)
    done = {}
    for name, (process, missing) in started.items():
        _, stderr = process.communicate(timeout=180)
        done[name] = (process.returncode, stderr, missing)
    return done


@pytest.mark.parametrize("name", sorted(NEEDS_DATABASE))
def test_a_command_without_a_database_says_it_in_one_line_and_creates_no_file(name, refusals):
    returncode, stderr, missing = refusals[name]
    # 1, or a checker's "could not check" (verify_audit: 2).
    assert returncode == load_command_class(get_commands()[name], name).refusal_returncode, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert f"there is no SQLite database at {missing}" in stderr and "postgres://" in stderr, stderr
    assert not missing.exists()


@pytest.mark.parametrize("name", ["set_budget", "rebuild_rollups"])
def test_a_command_with_database_url_unset_says_what_to_set_and_creates_no_file(name):
    if EMBEDDED.exists():
        pytest.skip(f"{EMBEDDED} exists (a quick start's leftover): nothing to see created")
    process = _run(name, NEEDS_DATABASE[name], "")
    _, stderr = process.communicate(timeout=120)
    created = EMBEDDED.exists()
    if created:
        EMBEDDED.unlink()  # leave the checkout as it was for the next test
    assert process.returncode == 1, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert "DATABASE_URL is not set" in stderr and "postgres://" in stderr, stderr
    assert not created


def test_a_command_that_needs_no_database_creates_no_file():
    if EMBEDDED.exists():
        pytest.skip(f"{EMBEDDED} exists: nothing to see created")
    for name, args in NEEDS_NONE.items():
        if args is not None:
            process = _run(name, args, "")
            _, stderr = process.communicate(timeout=120)
            created = EMBEDDED.exists()
            if created:
                EMBEDDED.unlink()
            assert process.returncode == 0, stderr
            assert not created, name
