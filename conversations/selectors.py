"""Reads of conversations shared by the API, the admin and the dashboard."""

from __future__ import annotations

import uuid

from yuxi_project.errors import NotFound

from .models import Conversation


def threads_of(user):
    """A user's threads, newest first (R-READ-5)."""
    return Conversation.objects.filter(user=user).order_by("-created_at", "-id")


def thread_of(user, thread_id: uuid.UUID) -> Conversation:
    """The user's thread; another user's thread is :class:`NotFound` (R-READ-5)."""
    thread = Conversation.objects.filter(pk=thread_id, user=user).first()
    if thread is None:
        raise NotFound("thread not found")
    return thread
