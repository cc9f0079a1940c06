"""``python manage.py export_scenario <run_id> [-o FILE]``: the turn of an
audited run as a replay scenario file (R-REPLAY-1).

    manage.py export_scenario 3f0c…e1 -o var/scenarios/incident_42.json

The file's stem is the scenario name the replay server serves it under
(``replay:<stem>``); without ``-o`` the JSON goes to standard output.
"""

from __future__ import annotations

import sys

from django.core.management.base import CommandError

from audit.replay.export import RunNotFound, export_scenario, scenario_json

from ._database import DatabaseCommand


class Command(DatabaseCommand):
    help = "Export the turn of an audited run as a replay scenario (JSON) that the replay model server plays."

    def add_arguments(self, parser):
        parser.add_argument("run_id", help="a run id: its whole turn (the first run and every resume) is exported")
        parser.add_argument("--output", "-o", help="a .json file to write (default: standard output)")

    def handle(self, *args, run_id, output, **options):
        try:
            text = scenario_json(export_scenario(run_id))
        except (RunNotFound, ValueError) as exc:
            raise CommandError(str(exc)) from None
        if not output:
            sys.stdout.write(text)
            sys.stdout.flush()
            return
        with open(output, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
        self.stderr.write(f"wrote the scenario of run {run_id} to {output}")
