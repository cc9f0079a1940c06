"""Reads of runs and their audit, shared by the API, the admin and the dashboard."""

from __future__ import annotations

import uuid

from yuxi_project.errors import NotFound

from .models import AgentRun


def run_of(user, run_id: uuid.UUID) -> AgentRun:
    """The user's run; another user's run is :class:`NotFound` (R-READ-5)."""
    run = AgentRun.objects.visible_to(user).filter(pk=run_id).first()
    if run is None:
        raise NotFound("run not found")
    return run
