"""Dashboard rollups (R-DASH-1, R-COST-2): hourly aggregates of the audit,
maintained exactly once per run inside its terminal transaction (see
:mod:`dashboard.rollups`), so a dashboard figure reads O(hours × groups)
rows instead of every audit row of its window.

Grain: one UTC hour (``hour`` is the hour's start, a UTC instant). Each
figure is bucketed by its own timestamp, the same one the row-based
figures use: runs by ``created_at``, ordinary messages by ``created_at``,
model calls (tokens, latency) and tool executions by ``started_at``, cost
by the call's ``finished_at``, feedback by the feedback's ``created_at``.
A calendar day of any zone whose offsets are whole hours is a whole number
of UTC hours, so ``tz`` still works; other zones fall back to the rows
(see :mod:`dashboard.selectors`).

Each hourly table has a per-UTC-day twin (:class:`RollupDay`,
:class:`RollupUserDay`, :class:`RollupLatencyDay`) with the same keys and
counters, ``day`` (a UTC calendar day) in place of ``hour``: a day row is
always the sum of the hour rows of its UTC day (both are written by the
same statements). A window's figures that are not per local day read the
day rows of its whole UTC days and the hour rows only at its edges, so a
30-day window reads about 30 rows per group instead of 720.

Rows are machine-written (INSERT … ON CONFLICT DO UPDATE adding deltas);
``python manage.py rebuild_rollups`` recomputes them from the audit rows.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from audit.models import AgentRun

from .triggers import USER_HOUR_TRIGGERS

RUN_STATUS_COLUMNS = tuple(f"runs_{status}" for status in AgentRun.Status.values)


def _counter(**extra):
    return models.BigIntegerField(default=0, db_default=0, **extra)


class RollupHour(models.Model):
    """Figures of one UTC hour × configured model × agent × tool.

    ``tool_name`` is ``""`` for every figure that is not about a tool
    execution; tool executions, successes and failures are on rows named
    after their tool, and summed over all tools on the ``""`` row
    (``all_tool_*``). ``cost_usd`` sums the known costs only
    (``closed_calls - unknown_cost_calls`` of them); it is 0 when none is
    known, and readers turn "no known cost" back into ``None`` (R-COST-1).
    """

    hour = models.DateTimeField()
    model = models.CharField(max_length=200)
    agent_id = models.CharField(max_length=100)
    tool_name = models.CharField(max_length=200, blank=True, default="")

    runs_pending = _counter()
    runs_running = _counter()
    runs_cancel_requested = _counter()
    runs_completed = _counter()
    runs_failed = _counter()
    runs_cancelled = _counter()
    runs_interrupted = _counter()
    messages = _counter(help_text="Ordinary messages (audit rows excluded, R-READ-4).")
    model_calls = _counter()
    input_tokens = _counter()
    output_tokens = _counter()
    total_tokens = _counter()
    unknown_usage_calls = _counter(help_text="Model calls without reported usage.")
    closed_calls = _counter(help_text="Model calls that closed in the hour (by finished_at).")
    unknown_cost_calls = _counter()
    cost_usd = models.DecimalField(max_digits=30, decimal_places=12, default=0, db_default=0)
    tool_executions = _counter()
    tool_successes = _counter()
    tool_failures = _counter()
    # On the row of no tool (tool_name ""): the hour's executions of every
    # tool, so per-day figures read one row per model and agent.
    all_tool_executions = _counter()
    all_tool_successes = _counter()
    all_tool_failures = _counter()
    likes = _counter()
    dislikes = _counter()

    class Meta:
        constraints = [
            # The upsert's conflict target; its leading hour also serves the
            # dashboard's window scans (WHERE hour >= start AND hour < end).
            models.UniqueConstraint(fields=["hour", "model", "agent_id", "tool_name"], name="rollup_hour_key"),
        ]
        indexes = [
            # Figures other than tools: WHERE tool_name = '' AND hour in the
            # window, without reading the rows of each tool.
            models.Index(fields=["tool_name", "hour"], name="rollup_tool_hour_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H}h {self.model} {self.agent_id} {self.tool_name or '-'}"


class RollupUserHour(models.Model):
    """Per-user figures of one UTC hour: ordinary user messages (active
    users are the users with one) and the cost of their closed model calls
    (costs by user). Kept apart from :class:`RollupHour` so the per-model
    and per-tool figures do not read one row per user."""

    hour = models.DateTimeField()
    # Not indexed alone: rollup_user_hour_key (user, hour) serves it.
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+", db_index=False)
    user_messages = _counter()
    closed_calls = _counter()
    unknown_cost_calls = _counter()
    cost_usd = models.DecimalField(max_digits=30, decimal_places=12, default=0, db_default=0)
    # Not indexed: rewriting it (when an hour before is added) is a HOT update.
    previous_active_hour = models.DateTimeField(
        null=True,
        editable=False,
        help_text="An hour in which the user was active (user messages): the hour they were last active before"
        " it; empty for their first. Kept by the database (dashboard.triggers).",
    )

    class Meta:
        constraints = [
            # User first: a user's hours in order (the hours the triggers
            # link, the probe of a user counted live).
            models.UniqueConstraint(fields=["user", "hour"], name="rollup_user_hour_key"),
        ]
        indexes = [
            # A window's edge hours (costs by user reads the whole days from
            # RollupUserDay): an index-only range scan.
            models.Index(
                fields=["hour"],
                include=["user", "user_messages", "closed_calls", "unknown_cost_calls", "cost_usd"],
                name="rollup_user_hour_idx",
            )
        ]
        # The links of active hours (RollupActiveHour, RollupActiveDay),
        # kept by the database.
        triggers = USER_HOUR_TRIGGERS


class RollupUserDay(models.Model):
    """:class:`RollupUserHour` summed over aligned blocks of UTC days: a row
    of ``span`` days (1, 2, 4, … :data:`dashboard.facts.USER_SPANS`)
    starting at ``day``, a multiple of ``span`` days after 1970-01-01. Any
    run of whole days is a handful of such blocks (at most two per span),
    so the window totals of costs by user read about 10 rows per user, not
    one per user and day (R-COST-2)."""

    day = models.DateField(help_text="First UTC day of the block.")
    span = models.SmallIntegerField(default=1, help_text="Days in the block (a power of two).")
    user = models.ForeignKey(
        # No index of its own: the unique key leads with the block, and
        # deleting a user (the only reader of such an index) is rare.
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        related_name="+",
        db_index=False,
    )
    user_messages = _counter()
    closed_calls = _counter()
    unknown_cost_calls = _counter()
    cost_usd = models.DecimalField(max_digits=30, decimal_places=12, default=0, db_default=0)

    class Meta:
        constraints = [
            # The upsert's conflict target and, covering the counters, one
            # index-only range scan per block of the window.
            models.UniqueConstraint(
                fields=["span", "day", "user"],
                include=["user_messages", "closed_calls", "unknown_cost_calls", "cost_usd"],
                name="rollup_user_day_key",
            ),
        ]


class RollupActiveHour(models.Model):
    """How many users were active (wrote an ordinary message, counted in
    :class:`RollupUserHour`) in the UTC hour ``hour`` and were last active
    before it in the hour ``since`` (``NULL``: never before). The users
    active in ``[start, end)`` are each counted once, on their first active
    hour in it: the links with ``since`` before ``start`` (or ``NULL``).
    Read for a window's edge hours; kept by the database
    (:mod:`dashboard.triggers`)."""

    hour = models.DateTimeField()
    since = models.DateTimeField(null=True, help_text="The hour the users were last active before (empty: never).")
    users = _counter()

    class Meta:
        constraints = [
            # The triggers' conflict target (one row for since NULL too);
            # covering users, one index-only range scan per edge.
            models.UniqueConstraint(
                fields=["hour", "since"], include=["users"], nulls_distinct=False, name="rollup_active_hour_key"
            ),
        ]


class RollupActiveDay(models.Model):
    """:class:`RollupActiveHour`'s links of each user's first active hour of
    the UTC day ``day`` (``since`` before the day), per ``(day, since)``:
    for the window's whole UTC days, a few rows per day (one per distinct
    hour its users were last active in), not one per user."""

    day = models.DateField(help_text="UTC day.")
    since = models.DateTimeField(null=True, help_text="The hour the users were last active before (empty: never).")
    users = _counter()

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["day", "since"], include=["users"], nulls_distinct=False, name="rollup_active_day_key"
            ),
        ]


class RollupLatencyHour(models.Model):
    """Completed model calls of one UTC hour × model by latency bucket: the
    sketch behind the dashboard's p50/p95 on large windows.

    Bucket 0 holds durations below 1 ms; bucket ``i >= 1`` holds
    ``[2**((i-1)/4), 2**(i/4))`` ms (four buckets per doubling, at most
    :data:`dashboard.facts.LATENCY_BUCKETS`). A percentile read from it
    is within +9.1 % / -8.3 % of the exact one (see
    :func:`dashboard.facts.bucket_value`)."""

    hour = models.DateTimeField()
    model = models.CharField(max_length=200)
    bucket = models.SmallIntegerField()
    calls = _counter()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["hour", "model", "bucket"], name="rollup_latency_key")]


class RollupDay(models.Model):
    """:class:`RollupHour` summed over one UTC day (same keys and counters,
    ``day`` in place of ``hour``)."""

    day = models.DateField(help_text="UTC calendar day.")
    model = models.CharField(max_length=200)
    agent_id = models.CharField(max_length=100)
    tool_name = models.CharField(max_length=200, blank=True, default="")

    runs_pending = _counter()
    runs_running = _counter()
    runs_cancel_requested = _counter()
    runs_completed = _counter()
    runs_failed = _counter()
    runs_cancelled = _counter()
    runs_interrupted = _counter()
    messages = _counter()
    model_calls = _counter()
    input_tokens = _counter()
    output_tokens = _counter()
    total_tokens = _counter()
    unknown_usage_calls = _counter()
    closed_calls = _counter()
    unknown_cost_calls = _counter()
    cost_usd = models.DecimalField(max_digits=30, decimal_places=12, default=0, db_default=0)
    tool_executions = _counter()
    tool_successes = _counter()
    tool_failures = _counter()
    all_tool_executions = _counter()
    all_tool_successes = _counter()
    all_tool_failures = _counter()
    likes = _counter()
    dislikes = _counter()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["day", "model", "agent_id", "tool_name"], name="rollup_day_key"),
        ]

    def __str__(self) -> str:
        return f"{self.day} {self.model} {self.agent_id} {self.tool_name or '-'}"


class RollupLatencyDay(models.Model):
    """:class:`RollupLatencyHour` summed over one UTC day."""

    day = models.DateField(help_text="UTC calendar day.")
    model = models.CharField(max_length=200)
    bucket = models.SmallIntegerField()
    calls = _counter()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["day", "model", "bucket"], name="rollup_latency_day_key")]


class RollupThreadHour(models.Model):
    """Conversations created in one UTC hour × the thread's model × agent,
    replay scratch threads excluded (``Conversation.objects.counted``).
    Written by the database, in the transaction that creates, deletes or
    relabels a thread (:mod:`conversations.triggers`); kept apart from
    :class:`RollupHour` so that creating a thread never waits for a run's
    terminal transaction, nor a run's end for a thread."""

    hour = models.DateTimeField()
    model = models.CharField(max_length=200)
    agent_id = models.CharField(max_length=100)
    conversations = _counter()

    class Meta:
        constraints = [
            # The triggers' conflict target; its leading hour serves the
            # dashboard's edge hours.
            models.UniqueConstraint(fields=["hour", "model", "agent_id"], name="rollup_thread_hour_key"),
        ]


class RollupThreadDay(models.Model):
    """:class:`RollupThreadHour` summed over one UTC day."""

    day = models.DateField(help_text="UTC calendar day.")
    model = models.CharField(max_length=200)
    agent_id = models.CharField(max_length=100)
    conversations = _counter()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["day", "model", "agent_id"], name="rollup_thread_day_key")]
