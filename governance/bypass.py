"""The one audited way past the append-only triggers (R-GOV-3)."""

from __future__ import annotations

import contextlib
import getpass
import os
from collections.abc import Iterator

from django.db import connection, transaction
from django.utils import timezone

from .models import GovernanceAction
from .triggers import BYPASS_SETTING


def current_actor() -> str:
    """Who runs this process: the operating-system user (and ``SUDO_USER``)."""
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry in some containers
        user = str(os.getuid())
    sudo = os.environ.get("SUDO_USER")
    return f"{user} (sudo from {sudo})" if sudo and sudo != user else user


def open_bypass(action: GovernanceAction) -> None:
    """Let the current transaction change audit rows and runs on behalf of
    ``action`` (an open :class:`GovernanceAction`). Must be called inside
    ``transaction.atomic()``: the setting is ``SET LOCAL`` and ends with the
    transaction. The triggers check that the action exists and is open."""
    if not connection.in_atomic_block:
        raise RuntimeError("open_bypass must be called inside transaction.atomic()")
    if action.finished_at is not None:
        raise RuntimeError(f"governance action {action.pk} is finished")
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config(%s, %s, true)", [BYPASS_SETTING, str(action.pk)])


@contextlib.contextmanager
def audited_bypass(*, reason: str, actor: str | None = None) -> Iterator[GovernanceAction]:
    """A recorded manual intervention: opens a ``manual`` governance action
    with ``reason``, runs the block in one transaction past the triggers, and
    closes the action. For operators and for tests that simulate a run lost
    behind the application's back; purge and erasure use their own actions."""
    action = GovernanceAction.objects.create(
        kind=GovernanceAction.Kind.MANUAL, actor=actor or current_actor(), criterion={"reason": reason}
    )
    try:
        with transaction.atomic():
            open_bypass(action)
            yield action
        action.status = GovernanceAction.Status.COMPLETED
    except BaseException:
        action.status = GovernanceAction.Status.STOPPED
        raise
    finally:
        action.finished_at = timezone.now()
        action.save(update_fields=["status", "finished_at"])
