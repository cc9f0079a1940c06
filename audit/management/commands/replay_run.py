"""``python manage.py replay_run <run_id|FILE> [--agent ID] [--tools recorded|live] [--junit FILE]``:
run an audited turn again and report where it diverged (R-REPLAY-2).

    manage.py replay_run 3f0c…e1
    manage.py replay_run var/scenarios/incident_42.json --junit var/replay.xml

The turn (resumes included) runs in this process on a scratch thread of
the replay user, against a replay model server that plays the exported
scenario; tools answer from the recorded results unless ``--tools live``.
No worker is needed. The report goes to standard output; the exit status
is 0 when the replay is identical, 1 when it diverged (and 2 when the
source cannot be replayed).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from django.core.management.base import CommandError

from audit.catalogue import UnknownAgent
from audit.execution.rerun import ReplaySourceError, load_source, record_replay, replay

from ._database import DatabaseCommand


class Command(DatabaseCommand):
    help = (
        "Run an audited turn (a run id, or a scenario file written by export_scenario) again against its recorded "
        "model answers and report the first divergence; exit 0 identical, 1 diverged."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "source", help="a run id (its whole turn: the first run and every resume) or a scenario file"
        )
        parser.add_argument("--agent", help="replay on this agent instead of the recorded one (e.g. a new version)")
        parser.add_argument(
            "--tools",
            choices=("recorded", "live"),
            default="recorded",
            help="recorded: tools answer with the recorded results (default); live: tools run for real",
        )
        parser.add_argument("--junit", help="also write the report as a JUnit XML file (for CI)")

    def handle(self, *args, source, agent, tools, junit, **options):
        # The replay's own model server logs each request: not the report.
        for name in ("audit.replay.server", "uvicorn", "uvicorn.error"):
            logging.getLogger(name).setLevel(logging.WARNING)
        try:
            scenario = load_source(source)
            report = replay(scenario, source=source, agent_id=agent, tools=tools)
        except (ReplaySourceError, UnknownAgent) as exc:
            raise CommandError(str(exc), returncode=2) from None
        # Shown on the recorded run's admin page, with the replays asked for there.
        record_replay(report, scenario.recorded.run_ids[-1])
        sys.stdout.write(report.text())
        sys.stdout.flush()
        if junit:
            Path(junit).write_text(report.junit_xml(), encoding="utf-8")
        if not report.identical:
            first = report.divergences[0]
            raise CommandError(f"the replay diverged at {first.where}: {first.what}", returncode=1)
