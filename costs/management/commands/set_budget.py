"""``python manage.py set_budget <username> --usd <amount> --period day|month``
(R-COST-3). ``--default`` instead of a username sets the default budget of
every user without one; ``--remove`` removes a budget."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from audit.management.commands._database import DatabaseCommand
from core.errors import InvalidInput
from costs.models import Budget
from costs.services import budget_remove, budget_set


class Command(DatabaseCommand):
    help = "Set a user's (or the default) spending limit in USD per day or month."

    def add_arguments(self, parser):
        parser.add_argument("username", nargs="?", help="the user; leave out with --default")
        parser.add_argument("--default", action="store_true", help="the default budget of users without one")
        parser.add_argument("--usd", help="the limit in USD, e.g. 5 or 0.25")
        parser.add_argument("--period", choices=Budget.Period.values, help="day or month (BUDGET_TIME_ZONE)")
        parser.add_argument("--remove", action="store_true", help="remove the budget instead")

    def handle(self, *args, username=None, default=False, usd=None, period=None, remove=False, **options):
        if bool(username) == bool(default):
            raise CommandError("give either a username or --default")
        user = None
        if username:
            user = get_user_model().objects.filter(username=username).first()
            if user is None:
                raise CommandError(f"no user {username!r}")
        who = username or "default"
        if remove:
            removed = budget_remove(user=user)
            self.stdout.write(f"budget of {who} removed" if removed else f"{who} had no budget")
            return
        if usd is None or period is None:
            raise CommandError("--usd and --period are required (or --remove)")
        try:
            budget = budget_set(user=user, limit_usd=usd, period=period)
        except InvalidInput as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(f"budget of {who}: {budget.limit_usd.normalize():f} USD per {budget.period}")
