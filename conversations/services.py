"""Writes of conversations."""

from __future__ import annotations

from audit.agents.assistant import validate_agent_id
from audit.agents.models import validate_model_name
from yuxi_project.config import get_config

from .models import Conversation


def thread_create(*, user, agent_id: str, model: str | None = None, title: str = "") -> Conversation:
    """Create a thread for ``user`` with agent ``agent_id`` and chat model
    ``model`` (default: ``DEFAULT_MODEL``).

    Raises:
        UnknownAgent: ``agent_id`` is not a built-in agent (422).
        UnknownModel: ``model`` is not in the configured model list (422).
    """
    validate_agent_id(agent_id)
    model = validate_model_name(model or get_config().DEFAULT_MODEL)
    return Conversation.objects.create(user=user, agent_id=agent_id, model=model, title=title[:200])
