from __future__ import annotations

import pytest

from tests.conftest import bearer

from .builders import tool_turn


@pytest.fixture
def api_world(thread, staff_user):
    """For the schema-generated requests: a thread with a finished tool
    turn (its ids, to put into generated paths) and the owner's and a
    staff user's token headers."""
    run = tool_turn(thread)
    return {
        "ids": {"thread_id": str(thread.id), "run_id": str(run.id), "message_id": run.output_message_id},
        "owner": bearer(thread.user),
        "staff": bearer(staff_user),
    }
