"""``python manage.py create_api_token <username> [--name NAME]``: issue a
Bearer token for the JSON APIs and print it once."""

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from conversations.models import ApiToken

from ._database import DatabaseCommand


class Command(DatabaseCommand):
    help = "Issue an API token for a user and print it (shown once; only its digest is stored)."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--name", default="cli", help="a label for the token")

    def handle(self, *args, username: str, name: str, **options):
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user named {username!r}")
        _, plaintext = ApiToken.objects.issue(user=user, name=name)
        self.stdout.write(plaintext)
