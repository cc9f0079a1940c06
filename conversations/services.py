"""Writes of conversations."""

from __future__ import annotations

import uuid

from django.db import IntegrityError, transaction

from audit.catalogue import validate_agent_id, validate_model_name
from audit.ledger.locks import web_lock_wait
from audit.models import AgentRun
from core.config import get_config
from core.errors import InvalidInput, NotFound
from core.storable import fit_text
from dashboard.rollups import feedback_changed

from .models import BLANK_CHARACTERS, Conversation, MessageFeedback, is_blank
from .selectors import message_feedback_of


def thread_create(*, user, agent_id: str, model: str | None = None, title: str = "") -> Conversation:
    """Create a thread for ``user`` with agent ``agent_id`` and chat model
    ``model`` (default: ``DEFAULT_MODEL``).

    Raises:
        UnknownAgent: ``agent_id`` is not a built-in agent (422).
        UnknownModel: ``model`` is not in the configured model list (422).
    """
    validate_agent_id(agent_id)
    model = validate_model_name(model or get_config().DEFAULT_MODEL)
    # A blank title is no title: the first turn names the thread (R-API-1).
    title = "" if is_blank(title) else fit_text(title, 200)
    return Conversation.objects.create(user=user, agent_id=agent_id, model=model, title=title)


def not_blank_pattern() -> str:
    """A regular expression (ECMA, Python and Rust alike) that finds a
    character outside :data:`BLANK_CHARACTERS`."""
    return "[^" + "".join(f"\\u{ord(c):04x}" for c in BLANK_CHARACTERS) + "]"


def thread_update(
    *, user, thread_id: uuid.UUID, title: str | None = None, archived: bool | None = None
) -> Conversation:
    """Rename, archive or restore one of ``user``'s threads (R-API-1): only
    the arguments given (not ``None``) change; ``updated_at`` moves only
    when something does. ``title``: not blank, at most 200 characters
    (stored as :func:`~core.storable.fit_text` keeps it); ``archived``:
    true archives the thread, false makes it active again. Archiving stops
    nothing: the thread's runs go on and it takes new turns.

    The row is locked (``FOR NO KEY UPDATE``, as a submission locks it)
    with a bounded wait, so that a rename never queues behind a busy thread
    for long.

    Raises:
        NotFound: no such thread of ``user`` (another user's thread too, R-READ-5).
        InvalidInput: a blank or too long title (``reason: bad_title``).
        RunBusy: the row was not granted within ``WEB_LOCK_TIMEOUT_MS`` (503,
            nothing changed).
    """
    if title is not None and (is_blank(title) or len(title) > 200):
        raise InvalidInput("title must not be blank and at most 200 characters", extra={"reason": "bad_title"})
    with web_lock_wait():
        thread = Conversation.objects.select_for_update(no_key=True).visible_to(user).filter(pk=thread_id).first()
        if thread is None:
            raise NotFound("thread not found")
        changed = []
        if title is not None and thread.title != fit_text(title, 200):
            thread.title = fit_text(title, 200)
            changed.append("title")
        if archived is not None and thread.archived != archived:
            thread.status = Conversation.Status.ARCHIVED if archived else Conversation.Status.ACTIVE
            changed.append("status")
        if changed:
            thread.save(update_fields=[*changed, "updated_at"])
    return thread


def message_feedback_submit(*, user, message_id: int, rating: str, reason: str = "") -> tuple[MessageFeedback, bool]:
    """Record ``user``'s ``rating`` (``like`` or ``dislike``) of a final
    answer, with an optional ``reason`` (at most 2000 characters). One
    feedback per user and message: a second one updates the first.

    Returns ``(feedback, created)``.

    Raises:
        NotFound: no such message in the user's threads (R-READ-5).
        InvalidInput: the message is not a final answer (a user message, an
            audit row, or an answer that only asks for tool calls, such as
            the one an interrupted run waits to have approved;
            ``reason: not_a_final_answer``), or a bad rating.
    """
    if rating not in MessageFeedback.Rating.values:
        raise InvalidInput("rating must be like or dislike", extra={"reason": "bad_rating"})
    message = message_feedback_of(user, message_id)
    is_final_answer = message.is_final_answer and AgentRun.objects.filter(output_message=message).exists()
    if not is_final_answer:
        raise InvalidInput("feedback is only for a final answer", extra={"reason": "not_a_final_answer"})
    values = {"rating": rating, "reason": reason[:2000]}
    try:
        return _feedback_save(message=message, user=user, values=values)
    except IntegrityError:
        # A concurrent first feedback won the insert: this one updates it.
        return _feedback_save(message=message, user=user, values=values)


def _feedback_save(*, message, user, values: dict) -> tuple[MessageFeedback, bool]:
    with transaction.atomic():
        # Locked so the rollup delta below starts from the rating it replaces.
        old_rating = (
            MessageFeedback.objects.select_for_update()
            .filter(message=message, user=user)
            .values_list("rating", flat=True)
            .first()
        )
        feedback, created = MessageFeedback.objects.update_or_create(message=message, user=user, defaults=values)
        feedback_changed(
            message_id=message.pk, created_at=feedback.created_at, old_rating=old_rating, new_rating=feedback.rating
        )
        return feedback, created
