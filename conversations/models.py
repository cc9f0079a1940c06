"""Threads, their messages (chat history and audit rows in one table) and
feedback.

One ``Message`` table holds ordinary chat messages *and* the audit rows of
model calls and tool executions, told apart by ``message_type`` (SPEC §3).
Every reader goes through the QuerySet predicates below, so that counts,
history and timelines apply the same rules (R-READ-1..4). Content fields
store what PostgreSQL cannot hold in an escaped form and read back the
original (``core.storable``, R-RUN-11).
"""

from __future__ import annotations

import hashlib
import secrets
import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q, Value

from conversations.triggers import THREAD_TRIGGERS
from core.storable import StorableCharField, StorableJSONField, StorableTextField, fit_text
from governance.triggers import MESSAGE_TRIGGERS

# The characters a title may not consist of only: Unicode White_Space and
# the BOM. One set for the server and the OpenAPI pattern, so that JSON
# Schema (ECMA), pydantic (Rust) and Python agree on "blank"; their own
# "\s" differ (U+001C..U+001F, U+0085, U+FEFF).
BLANK_CHARACTERS = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680"
    + "".join(chr(c) for c in range(0x2000, 0x200B))
    + "\u2028\u2029\u202f\u205f\u3000\ufeff"
)


def is_blank(text: str) -> bool:
    """Whether ``text`` holds only :data:`BLANK_CHARACTERS` (or nothing):
    a blank title is no title (R-API-1)."""
    return not text.strip(BLANK_CHARACTERS)


#: How many words of its first message name an untitled thread.
TITLE_WORDS = 8


def title_from_text(text: str) -> str:
    """The first :data:`TITLE_WORDS` words of ``text`` on one line, with
    "…" when there were more, cut to fit the 200-character title (R-API-1).
    ``"Plan a trip to Paris"`` -> ``"Plan a trip to Paris"``; blank text
    gives ``""``."""
    words = text.split(maxsplit=TITLE_WORDS)  # the rest stays one piece: a long text is not split whole
    head = " ".join(words[:TITLE_WORDS])
    return fit_text(head + "…" if len(words) > TITLE_WORDS else head, 200)


class ConversationQuerySet(models.QuerySet):
    def counted(self) -> ConversationQuerySet:
        """Threads the dashboard counts: not the scratch thread of a replay
        (one holding a replayed run; ``AgentRunQuerySet.counted``, issue 34)."""
        return self.exclude(runs__replay_of__gt="")

    def archived(self, value: bool = True) -> ConversationQuerySet:
        """Threads their owner archived (``value=False``: those not
        archived). Archived is a status, not a deletion: the thread keeps
        its history and runs, and takes new turns (R-API-1)."""
        rows = self.filter(status=Conversation.Status.ARCHIVED)
        return rows if value else self.exclude(status=Conversation.Status.ARCHIVED)

    def visible_to(self, user) -> ConversationQuerySet:
        """``user``'s threads the API shows (R-READ-5): not those they
        deleted (R-API-1), which stay for the audit and the statistics."""
        return self.filter(user=user).exclude(status=Conversation.Status.DELETED)

    def awaiting_erasure(self) -> ConversationQuerySet:
        """Deleted threads whose content is not erased yet (R-API-1): the
        erasure waits for their runs to end (index ``conv_awaiting_erasure_idx``)."""
        return self.filter(status=Conversation.Status.DELETED, erased_at__isnull=True)


class Conversation(models.Model):
    """A chat between one user and one agent: the *thread* of LangGraph."""

    class Status(models.TextChoices):
        ACTIVE = "active"
        ARCHIVED = "archived"
        # Deleted by its owner (R-API-1): gone from the API at once, its
        # content erased as R-GOV-2 erases a user's (``erased_at``), its
        # anonymous facts kept for statistics.
        DELETED = "deleted"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # Not indexed alone: conv_user_created_idx (user, -created_at) serves it.
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="conversations", db_index=False
    )
    agent_id = models.CharField(max_length=100)
    model = models.CharField(max_length=200)
    title = StorableCharField(max_length=200, blank=True, default="")
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.ACTIVE)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    # When a deleted thread's content was erased (R-API-1, R-GOV-2); null
    # while the erasure waits for its runs to end, and for every other thread.
    erased_at = models.DateTimeField(null=True, blank=True)
    # Whether one of the thread's runs is a replay (a replay's scratch
    # thread, which no figure counts): set by the database when a run's
    # replay_of changes (conversations.triggers), never by the application.
    # The dashboard's conversation counts follow it; ``counted()`` reads the
    # runs themselves. ``db_default``: rows inserted by raw SQL hold none.
    holds_replay = models.BooleanField(default=False, db_default=False, editable=False)

    objects = ConversationQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        # The dashboard's conversation counts per hour (conversations.triggers).
        triggers = THREAD_TRIGGERS
        indexes = [
            # GET /api/threads: a user's threads, newest first.
            models.Index(fields=["user", "-created_at"], name="conv_user_created_idx"),
            # Admin thread list, newest first; dashboard conversations per day.
            models.Index(fields=["created_at"], name="conv_created_idx"),
            # The erasure sweep: deleted threads not yet erased (few, or none).
            models.Index(
                fields=["created_at"],
                name="conv_awaiting_erasure_idx",
                condition=models.Q(status="deleted", erased_at__isnull=True),
            ),
        ]

    def __str__(self) -> str:
        return self.title or str(self.id)

    @property
    def thread_id(self) -> uuid.UUID:
        return self.id

    @property
    def archived(self) -> bool:
        """Whether the owner archived the thread (R-API-1)."""
        return self.status == Conversation.Status.ARCHIVED

    def name_after(self, text: str) -> bool:
        """Give an untitled thread the title :func:`title_from_text` makes of
        ``text`` (its first turn's input, R-API-1); the caller saves. Returns
        whether the title changed: False for a thread that has a title, or
        for a text whose words are blank too (the next turn names it)."""
        if not is_blank(self.title):
            return False
        title = title_from_text(text)
        if is_blank(title):
            return False
        self.title = title
        return True


class MessageQuerySet(models.QuerySet):
    """Predicates every reader shares (R-READ-1..4)."""

    def ordinary(self) -> MessageQuerySet:
        """Chat messages a user sees and counts see: never audit rows (R-READ-4)."""
        return self.filter(message_type=Message.Type.TEXT)

    def audit(self) -> MessageQuerySet:
        """Rows that record one operation (model call or tool execution),
        including the model row that became a run's final answer."""
        return self.filter(operation_id__isnull=False)

    def model_calls(self) -> MessageQuerySet:
        return self.audit().filter(role=Message.Role.ASSISTANT)

    def tool_executions(self) -> MessageQuerySet:
        """Tool rows that really started; a declaration or a rejected call
        never counts as an execution (R-READ-4, R-TA-5)."""
        return self.filter(message_type=Message.Type.TOOL_AUDIT, started_at__isnull=False)

    def cost_unknown(self) -> MessageQuerySet:
        """Model calls that ended without a known cost: cut off before the
        provider reported usage, or no price for their model. They are
        counted as ``unknown_cost_calls``, never as 0 USD (R-COST-1)."""
        return (
            self.model_calls().filter(cost_usd__isnull=True).exclude(execution_status=Message.ExecutionStatus.RUNNING)
        )

    def counted(self) -> MessageQuerySet:
        """Rows the dashboard and the cost statistics count: not those of a
        replayed run (``AgentRunQuerySet.counted``, issue 34); rows without
        a run stay."""
        return self.exclude(run__replay_of__gt="")

    def running(self) -> MessageQuerySet:
        return self.filter(execution_status=Message.ExecutionStatus.RUNNING)

    def visible_in_history(self) -> MessageQuerySet:
        """What the chat history and the agent's memory show (R-READ-1,
        R-READ-2): user messages, final answers, and model rows as
        tool-display carriers only when their run is terminal, the terminal
        reconcile proved them (``state_reconciled``) and they declared tool
        calls. Running and unproven rows never match, nor does any call
        made inside a subgraph or subagent (R-SUB-1)."""
        from audit.models import AgentRun

        carrier = history_carrier_q() & Q(run__status__in=AgentRun.TERMINAL_STATUSES)
        return self.filter(history_ordinary_q() | carrier)


def history_ordinary_q() -> Q:
    """The ordinary messages of the history: user messages and final
    answers (R-READ-1). Half of :meth:`MessageQuerySet.visible_in_history`;
    the history and memory readers, which read a thread's runs before their
    rows, apply it in SQL with :func:`history_carrier_q`."""
    return Q(message_type=Message.Type.TEXT, role__in=[Message.Role.USER, Message.Role.ASSISTANT])


def history_carrier_q() -> Q:
    """A model row that may show in the history as a tool-display carrier,
    as far as the row itself tells: proved by the terminal reconcile,
    declaring tool calls, and made at the root, not inside a subgraph or
    subagent (R-SUB-1). Its run must also be terminal (R-READ-1)."""
    return (
        Q(message_type=Message.Type.MODEL_AUDIT, role=Message.Role.ASSISTANT)
        & Q(metadata__state_reconciled=True)
        & Q(tool_calls__isnull=False)
        & ~Q(tool_calls=[])
        & Q(namespace=[])
    )


class Message(models.Model):
    """One chat message or one audit row (R-MA-1, R-TA-1)."""

    class Role(models.TextChoices):
        USER = "user"
        ASSISTANT = "assistant"
        TOOL = "tool"
        SYSTEM = "system"

    class Type(models.TextChoices):
        TEXT = "text"
        MODEL_AUDIT = "model_audit"
        TOOL_AUDIT = "tool_audit"

    class ExecutionStatus(models.TextChoices):
        RUNNING = "running"
        COMPLETED = "completed"
        FAILED = "failed"
        INTERRUPTED = "interrupted"
        ABANDONED = "abandoned"
        REJECTED = "rejected"

    TERMINAL_EXECUTION_STATUSES = frozenset(
        {
            ExecutionStatus.COMPLETED,
            ExecutionStatus.FAILED,
            ExecutionStatus.INTERRUPTED,
            ExecutionStatus.ABANDONED,
            ExecutionStatus.REJECTED,
        }
    )

    # Not indexed alone: message_thread_id_idx (thread, id) serves every
    # lookup by thread, and each index costs every audit row's writes.
    thread = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="messages", db_index=False)
    run = models.ForeignKey("audit.AgentRun", on_delete=models.CASCADE, null=True, blank=True, related_name="messages")
    role = models.CharField(max_length=20, choices=Role.choices)
    message_type = models.CharField(max_length=20, choices=Type.choices, default=Type.TEXT)
    content = StorableTextField(blank=True, default="")
    # Tool calls the model declared (model rows only): [{id, name, args}].
    tool_calls = StorableJSONField(null=True, blank=True)
    # Audit metadata: namespace, model name, state_reconciled proof, the raw
    # tool output envelope (staff only), awaiting_run_terminal, ...
    metadata = StorableJSONField(default=dict, blank=True)
    # --- audit columns (R-MA-1); empty on rows that are not audit rows ---
    operation_id = StorableCharField(max_length=255, null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    duration_ms = models.PositiveIntegerField(null=True, blank=True)
    sequence = models.PositiveIntegerField(null=True, blank=True)
    execution_status = models.CharField(max_length=20, choices=ExecutionStatus.choices, null=True, blank=True)
    usage = StorableJSONField(null=True, blank=True)
    # Why ``usage`` is null when the worker knows: ``usage_mode_conflict``
    # (the stream's reports contradict the model's usage mode, R-MA-12).
    # Null for known usage and for a call cut off before its report.
    usage_cause = models.CharField(max_length=40, null=True, blank=True)
    # --- cost of a model call (R-COST-1, costs.pricing): USD, null while
    # unknown (never 0 for unknown); where the price came from and which
    # version of it. An empty source means "not priced (yet)". ---
    cost_usd = models.DecimalField(max_digits=24, decimal_places=12, null=True, blank=True)
    # db_default: rows written by raw SQL (tooling, bulk loads) need no price fields.
    price_source = models.CharField(max_length=40, blank=True, default="", db_default="")
    price_version = models.CharField(max_length=100, blank=True, default="", db_default="")
    # --- tool rows (R-TA-1) ---
    tool_name = StorableCharField(max_length=200, blank=True, default="")
    tool_input = StorableJSONField(null=True, blank=True)
    declared_by = models.ForeignKey(
        "self", on_delete=models.SET_NULL, null=True, blank=True, related_name="tool_executions"
    )
    # --- subagents (R-SUB-1): the stream namespace of the call (``[]`` at
    # the root, ``["tools:<task id>"]`` inside a subagent) and the tool call
    # id of the ``task`` call that spawned it (null at the root). db_default:
    # rows written by raw SQL are root rows. ---
    namespace = models.JSONField(default=list, blank=True, db_default=Value([], output_field=models.JSONField()))
    parent_operation_id = StorableCharField(max_length=255, null=True, blank=True)
    # --- effect ledger (R-EFF-1, R-RUN-15): a tool row's effect key, the
    # same when its run is retried (``audit.ledger.tool_audit.effect_key``;
    # null on every other row); the original tool row a replayed result
    # came from (null unless replayed); the run attempt that wrote the row.
    # db_default: rows written by raw SQL are of a first attempt. ---
    effect_key = models.TextField(null=True, blank=True)
    replayed_from = models.ForeignKey("self", on_delete=models.SET_NULL, null=True, blank=True, related_name="replays")
    attempt = models.PositiveSmallIntegerField(default=1, db_default=1)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = MessageQuerySet.as_manager()

    class Meta:
        # Closed audit rows are append-only; audit rows are never deleted
        # (R-GOV-3, governance.triggers).
        triggers = MESSAGE_TRIGGERS
        constraints = [
            # One row per operation of a run attempt; model and tool ids are
            # separate namespaces because the role is part of the key
            # (R-MA-1). A run continued by another worker executes a tool
            # call again, or replays it, in a row of its new attempt
            # (R-RUN-15, R-EFF-1); the earlier attempt's row stays as it was.
            models.UniqueConstraint(
                fields=["run", "role", "operation_id", "attempt"],
                condition=Q(operation_id__isnull=False),
                name="message_run_role_operation_uniq",
            ),
        ]
        indexes = [
            # History: a thread's ordinary messages in order.
            models.Index(fields=["thread", "id"], name="message_thread_id_idx"),
            # Timeline: a run's audit rows by sequence.
            models.Index(
                fields=["run", "sequence", "id"],
                name="message_run_sequence_idx",
                condition=Q(operation_id__isnull=False),
            ),
            # Dashboard: tool executions by name and time.
            models.Index(
                fields=["tool_name", "started_at"],
                name="message_tool_started_idx",
                condition=Q(message_type="tool_audit"),
            ),
            # Dashboard: ordinary messages in a date range (R-READ-4 counts).
            models.Index(
                fields=["created_at"],
                name="message_text_created_idx",
                condition=Q(message_type="text"),
            ),
            # Dashboard: model calls and tool executions in a date range.
            models.Index(
                fields=["started_at"],
                name="message_audit_started_idx",
                condition=Q(operation_id__isnull=False),
            ),
            # Cost (R-COST-2, R-COST-3): a user's spend in the current budget
            # period and the dashboard's cost window select model calls by
            # the time they closed.
            models.Index(
                fields=["finished_at"],
                name="message_model_finished_idx",
                condition=Q(operation_id__isnull=False, role="assistant"),
            ),
            # Search by exact operation id (tool call id) across runs (R-ADM-2).
            models.Index(
                fields=["operation_id"],
                name="message_operation_idx",
                condition=Q(operation_id__isnull=False),
            ),
            # Effect ledger (R-EFF-1): "a completed tool row with this effect
            # key among the runs of this turn" (the key names the turn).
            models.Index(
                fields=["effect_key"],
                name="message_effect_key_idx",
                condition=Q(effect_key__isnull=False),
            ),
            # Terminal transaction and sweeper: a run's rows still running.
            models.Index(
                fields=["run"],
                name="message_run_running_idx",
                condition=Q(execution_status="running"),
            ),
        ]

    def __str__(self) -> str:
        label = self.operation_id or self.pk
        return f"{self.get_message_type_display()} {self.role} {label}"

    @property
    def is_audit(self) -> bool:
        return self.operation_id is not None

    @property
    def asks_for_tools(self) -> bool:
        """A model answer that declares tool calls (e.g. the call an
        interrupted run waits to have approved): it asks for tools, it
        answers nothing yet."""
        return bool(self.tool_calls)

    @property
    def is_final_answer(self) -> bool:
        """An assistant text that answers the user: the ordinary assistant
        message bound as a run's output, unless it only declares tool calls
        (the model row of an interrupted run that waits for approval).
        Feedback is taken only on these (R-READ-4, R-TA-5)."""
        return (
            self.message_type == Message.Type.TEXT and self.role == Message.Role.ASSISTANT and not self.asks_for_tools
        )


class MessageFeedbackQuerySet(models.QuerySet):
    def ordinary(self) -> MessageFeedbackQuerySet:
        """Feedback on ordinary chat messages only: feedback attached to an
        audit row never enters statistics or the feedback list (R-READ-4)."""
        return self.filter(message__message_type=Message.Type.TEXT)

    def counted(self) -> MessageFeedbackQuerySet:
        """Feedback the dashboard counts: not on a replayed run's messages
        (``MessageQuerySet.counted``, issue 34)."""
        return self.exclude(message__run__replay_of__gt="")


class MessageFeedback(models.Model):
    """A user's like or dislike of a final answer (one per user and message)."""

    class Rating(models.TextChoices):
        LIKE = "like"
        DISLIKE = "dislike"

    # Not indexed alone: feedback_message_user_uniq (message, user) serves it.
    message = models.ForeignKey(Message, on_delete=models.CASCADE, related_name="feedback", db_index=False)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="message_feedback")
    rating = models.CharField(max_length=10, choices=Rating.choices)
    reason = StorableTextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = MessageFeedbackQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["message", "user"], name="feedback_message_user_uniq"),
        ]
        indexes = [
            # Dashboard feedback list, newest first.
            models.Index(fields=["-created_at"], name="feedback_created_idx"),
        ]


class ApiTokenManager(models.Manager):
    def issue(self, *, user, name: str = "") -> tuple[ApiToken, str]:
        """Create a token for ``user``; returns (row, plaintext). The
        plaintext is shown once; only its SHA-256 digest is stored."""
        plaintext = "yx_" + secrets.token_urlsafe(32)
        token = self.create(user=user, name=name, key_digest=ApiToken.digest(plaintext), prefix=plaintext[:10])
        return token, plaintext


class ApiToken(models.Model):
    """A per-user bearer token for the JSON APIs (``Authorization: Bearer``)."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100, blank=True, default="")
    prefix = models.CharField(max_length=16, editable=False)
    key_digest = models.CharField(max_length=64, unique=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    objects = ApiTokenManager()

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.user})"

    @staticmethod
    def digest(plaintext: str) -> str:
        return hashlib.sha256(plaintext.encode()).hexdigest()
