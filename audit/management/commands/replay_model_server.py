"""``python manage.py replay_model_server [--host H] [--port P] [--scenario-dir DIR]``:
serve the replay model server (SPEC §5); see :mod:`audit.replay.server`."""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from audit.replay.scenarios import ScenarioError
from audit.replay.server import serve


class Command(BaseCommand):
    help = (
        "Serve the replay model server: an OpenAI-compatible /v1/chat/completions endpoint that "
        "plays scenario files (the model name is the scenario name). Prints "
        "'replay model server listening on http://HOST:PORT/v1' once it accepts connections."
    )
    requires_system_checks = []  # needs no database or models

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
        parser.add_argument("--port", type=int, default=8765, help="TCP port; 0 picks a free one (default 8765)")
        parser.add_argument(
            "--scenario-dir", type=Path, default=None, help="directory of *.json scenarios (default: the bundled ones)"
        )

    def handle(self, *args, host: str, port: int, scenario_dir: Path | None, **options) -> None:
        def announce(base_url: str) -> None:
            self.stdout.write(f"replay model server listening on {base_url}")
            self.stdout.flush()

        try:
            serve(host, port, scenario_dir, on_listening=announce)
        except (ScenarioError, NotADirectoryError) as exc:
            raise CommandError(str(exc)) from exc
