"""``python manage.py publish_digest``: publish the signed digests that
are due (R-GOV-5); Celery beat does the same every minute when a key is
set.

    export AUDIT_SIGNING_KEY_FILE=/etc/yuxi/digest-key.pem
    manage.py publish_digest
"""

from __future__ import annotations

from django.core.management.base import CommandError

from audit.management.commands._database import DatabaseCommand
from core.config import get_config
from governance.digests import DigestKeyError, publish_digests, signing_key


class Command(DatabaseCommand):
    help = (
        "Publish the signed digest of every audit interval that ended and has none yet: stored in the database "
        "and appended to AUDIT_DIGEST_DIR/digests.jsonl. Needs AUDIT_SIGNING_KEY or "
        "AUDIT_SIGNING_KEY_FILE."
    )

    def handle(self, *args, **options):
        try:
            if signing_key() is None:
                raise CommandError(
                    "no digest key: set AUDIT_SIGNING_KEY_FILE (or AUDIT_SIGNING_KEY) to an Ed25519 "
                    "private key in PEM, e.g. made by `openssl genpkey -algorithm ed25519 -out digest-key.pem`"
                )
            made = publish_digests()
        except DigestKeyError as exc:
            raise CommandError(str(exc)) from None
        except OSError as exc:
            raise CommandError(f"cannot write {get_config().AUDIT_DIGEST_DIR}: {exc}") from None
        for digest in made:
            self.stdout.write(
                f"digest #{digest.sequence}: {digest.interval_start:%Y-%m-%d %H:%M}–{digest.interval_end:%H:%M} UTC, "
                f"{digest.leaf_count} leaves, root {digest.root[:16]}…"
            )
        self.stdout.write(f"{len(made)} digest(s) published to {get_config().AUDIT_DIGEST_DIR}")
