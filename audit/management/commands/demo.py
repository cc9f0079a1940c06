"""``python manage.py demo --base-url URL``: the quick start's demo turns."""

import httpx
from django.core.management.base import CommandError

from audit.demo import ensure_demo_user, run_demo

from ._database import DatabaseCommand


class Command(DatabaseCommand):
    help = "Create the demo admin user, submit a few turns over the HTTP API and print their audit."

    def add_arguments(self, parser):
        parser.add_argument("--base-url", default="http://127.0.0.1:8000")
        parser.add_argument("--username", default="admin")
        parser.add_argument("--password", default="admin")
        parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each run")

    def handle(self, *args, base_url, username, password, timeout, **options):
        demo_user = ensure_demo_user(username=username, password=password)
        token = demo_user.token
        if demo_user.created:
            self.stdout.write(f"Created the admin user {username!r} (password {password!r}).")
        else:
            self.stdout.write(f"The user {username!r} exists: its password is unchanged; the demo token was rotated.")
        self.stdout.write(f"Submitting demo turns to {base_url} ...")
        try:
            runs = run_demo(base_url=base_url, token=token, timeout=timeout, say=self.stdout.write)
        except (httpx.HTTPError, TimeoutError) as exc:
            raise CommandError(f"demo failed: {exc}") from exc
        first = runs[1] if len(runs) > 1 else runs[0]
        auth = f"-H 'Authorization: Bearer {token}'"
        lines = [
            ("chat", f"{base_url}/chat/   (sign in as {username})"),
            (
                "admin",
                f"{base_url}/admin/   (user {username}, "
                + (f"password {password})" if demo_user.created else "your password for it)"),
            ),
            ("dashboard", f"{base_url}/admin/dashboard/"),
            ("API docs", f"{base_url}/api/docs"),
            ("a run", f"curl -s {auth} {base_url}/api/runs/{first.run_id}"),
            ("its history", f"curl -s {auth} {base_url}/api/threads/{first.thread_id}/history"),
            ("its audit", f"curl -s {auth} {base_url}/api/audit/runs/{first.run_id}/timeline"),
            ("find runs", f"curl -s {auth} '{base_url}/api/audit/runs?tool=get_weather&q=Paris'"),
            ("export", f"curl -s {auth} '{base_url}/api/audit/runs/{first.run_id}/export?format=csv'"),
        ]
        waiting = next((run for run in runs if run.status == "interrupted"), None)
        if waiting is not None:
            lines.append(
                (
                    "approve",
                    f"curl -sX POST {auth} -H 'Content-Type: application/json' {base_url}/api/runs/{waiting.run_id}/resume"
                    f""" -d '{{"request_id": "approve-{waiting.run_id[:8]}", "decisions": [{{"type": "approve"}}]}}'""",
                )
            )
        self.stdout.write("\nWhere to look:")
        for label, value in lines:
            self.stdout.write(f"  {label + ':':<13} {value}")
