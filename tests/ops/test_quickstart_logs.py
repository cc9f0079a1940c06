"""``bin/quickstart`` keeps the previous run's logs: before it writes any,
``rotate_logs`` (bin/_python.sh) moves each of its logs to ``<name>.log.1``,
one generation, instead of the new run truncating them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = (REPO / "bin" / "quickstart").read_text(encoding="utf-8")


def _rotate(log_dir: Path, *names: str) -> None:
    subprocess.run(
        ["bash", "-c", 'set -euo pipefail; source bin/_python.sh; rotate_logs "$@"', "rotate", str(log_dir), *names],
        cwd=REPO,
        check=True,
        timeout=30,
    )


def test_rotate_logs_keeps_one_previous_generation_of_the_named_logs(tmp_path):
    (tmp_path / "web.log").write_text("run 2\n")
    (tmp_path / "web.log.1").write_text("run 1\n")
    (tmp_path / "replay.log").write_text("replay of run 2\n")
    (tmp_path / "pip-install-main.log").write_text("not the quick start's\n")

    _rotate(tmp_path, "web", "replay", "worker")  # worker.log does not exist: nothing to keep

    assert (tmp_path / "web.log.1").read_text() == "run 2\n"
    assert (tmp_path / "replay.log.1").read_text() == "replay of run 2\n"
    assert not (tmp_path / "web.log").exists() and not (tmp_path / "replay.log").exists()
    assert not (tmp_path / "worker.log.1").exists()
    assert (tmp_path / "pip-install-main.log").read_text() == "not the quick start's\n"


def test_the_quick_start_rotates_every_log_it_writes_before_writing_one():
    call = re.search(r'^rotate_logs "\$LOG_DIR" (.+)$', QUICKSTART, re.M)
    assert call, "bin/quickstart does not call rotate_logs on $LOG_DIR"
    rotated = set(call.group(1).split())
    written = set(re.findall(r'"\$LOG_DIR/([\w-]+)\.log"', QUICKSTART))
    assert written and written <= rotated, f"logs bin/quickstart writes but does not keep: {written - rotated}"
    first_write = min(m.start() for m in re.finditer(r'>>?"\$LOG_DIR/', QUICKSTART))
    assert call.start() < first_write
