"""Find runs by what happened in them (R-ADM-2).

One definition of every run filter, shared by the staff API
(``GET /api/audit/runs``), the admin run list, the export (API, admin
action, management command) and the message list search:

* run columns: ``status``, ``error_type``, ``model``, ``agent``, ``user``,
  a creation time range (``from``/``to``), ``min_duration_ms``;
* what the run's audit rows hold: ``tool`` and ``tool_status`` (one tool row
  with both), ``rejected`` (a tool call a reviewer rejected),
  ``min_cost_usd`` (the sum of the run's known model-call costs);
* ``q``: a run, thread or turn id (or the first 8+ hex digits of one, as
  the admin shows them), a request id, an operation id (tool call id), or
  words that one of the run's messages or audit rows holds (every word in
  the same row: "where did the model say X"). Words are matched with
  PostgreSQL full-text search on the generated ``search_vector`` column in
  the language-neutral ``simple`` configuration, GIN-indexed (migration
  ``conversations.0003_audit_search``); the query is
  ``websearch_to_tsquery`` syntax: ``"exact phrase"``, ``or``, ``-word``.

Filters that look into audit rows are ``run IN (SELECT run_id ...)``
subqueries driven by an index of the message table, so a rare match does
not scan the runs table newest-first.
"""

from __future__ import annotations

import datetime as dt
import re
import uuid
from dataclasses import dataclass, fields
from decimal import Decimal
from typing import Any

from django.db import connections
from django.db.models import (
    BooleanField,
    DurationField,
    Exists,
    Expression,
    ExpressionWrapper,
    F,
    OuterRef,
    Q,
    QuerySet,
    Sum,
)
from django.db.models.functions import Coalesce, Now
from django.utils import timezone

from conversations.models import Message
from yuxi_project.cursors import decode_cursor, encode_cursor
from yuxi_project.errors import InvalidInput

from .models import AgentRun

RUN_LIST_MAX = 200
# Hex digits of an id the admin shows (``str(run.id)[:8]``): the shortest
# id prefix the search takes as an id.
ID_PREFIX_MIN = 8
_HEX = re.compile(r"^[0-9a-f]+$")


@dataclass(frozen=True)
class RunFilters:
    """Parsed run filters; ``None`` (or an empty tuple) means "any".

    ``status`` is a tuple of run statuses; ``created_from``/``created_to``
    are aware datetimes (``from`` inclusive, ``to`` exclusive);
    ``min_duration_ms`` in ms (a running run counts up to now);
    ``min_cost_usd`` in USD; ``rejected`` true keeps runs with a rejected
    approval, false those without one.
    """

    status: tuple[str, ...] = ()
    error_type: str | None = None
    model: str | None = None
    agent: str | None = None
    user: str | None = None
    created_from: dt.datetime | None = None
    created_to: dt.datetime | None = None
    tool: str | None = None
    tool_status: str | None = None
    rejected: bool | None = None
    min_duration_ms: int | None = None
    min_cost_usd: Decimal | None = None
    q: str | None = None

    @property
    def empty(self) -> bool:
        return all(getattr(self, f.name) in (None, ()) for f in fields(self))


def parse_statuses(value: str | None) -> tuple[str, ...]:
    """``"failed,cancelled"`` → ``("failed", "cancelled")``.

    Raises:
        InvalidInput: an unknown status (``field: status``).
    """
    statuses = tuple(s.strip() for s in (value or "").split(",") if s.strip())
    unknown = [s for s in statuses if s not in AgentRun.Status.values]
    if unknown:
        raise InvalidInput(
            f"unknown run status {unknown[0]!r}", extra={"field": "status", "allowed": list(AgentRun.Status.values)}
        )
    return statuses


def aware(value: dt.datetime | None) -> dt.datetime | None:
    """A naive time is read in the server's zone (UTC)."""
    if value is None or timezone.is_aware(value):
        return value
    return timezone.make_aware(value)


def _in_utc(value: dt.datetime, field: str) -> dt.datetime:
    """``value`` in UTC: PostgreSQL refuses offsets beyond ±15:59 that
    Python accepts (``+16:00``), and a time next to year 1 or 9999 may not
    move into UTC at all (R-READ-6: 422, not 500)."""
    try:
        return aware(value).astimezone(dt.UTC)
    except OverflowError:
        raise InvalidInput(f"'{field}' is out of range", extra={"field": field}) from None


def filter_runs(runs: QuerySet[AgentRun], filters: RunFilters) -> QuerySet[AgentRun]:
    """``runs`` narrowed to those matching every filter (R-ADM-2).

    Raises:
        InvalidInput: ``from`` not before ``to``, a time out of range.
    """
    f = filters
    if f.created_from and f.created_to and f.created_from >= f.created_to:
        raise InvalidInput("'from' must be before 'to'", extra={"field": "from"})
    if f.status:
        runs = runs.filter(status__in=f.status)
    if f.error_type:
        runs = runs.filter(error_type=f.error_type)
    if f.model:
        runs = runs.filter(model=f.model)
    if f.agent:
        runs = runs.filter(agent_id=f.agent)
    if f.user:
        runs = runs.filter(user_condition(f.user))
    if f.created_from:
        runs = runs.filter(created_at__gte=_in_utc(f.created_from, "from"))
    if f.created_to:
        runs = runs.filter(created_at__lt=_in_utc(f.created_to, "to"))
    if f.tool or f.tool_status:
        tool_rows = Message.objects.filter(message_type=Message.Type.TOOL_AUDIT)
        if f.tool:
            tool_rows = tool_rows.filter(tool_name=f.tool)
        if f.tool_status:
            tool_rows = tool_rows.filter(execution_status=f.tool_status)
        # EXISTS, correlated on the run: PostgreSQL may then walk the runs
        # newest first and probe each run's few rows by its index, stopping
        # at the page's end, instead of hashing every matching tool row of
        # the table first (a common tool has hundreds of thousands).
        runs = runs.filter(Exists(tool_rows.filter(run_id=OuterRef("pk"))))
    if f.rejected is not None:
        rejected = Exists(
            Message.objects.filter(
                run_id=OuterRef("pk"),
                message_type=Message.Type.TOOL_AUDIT,
                execution_status=Message.ExecutionStatus.REJECTED,
            )
        )
        runs = runs.filter(rejected) if f.rejected else runs.exclude(rejected)
    if f.min_duration_ms is not None:
        runs = runs.filter(started_at__isnull=False).alias(
            run_duration=ExpressionWrapper(Coalesce("finished_at", Now()) - F("started_at"), DurationField())
        )
        runs = runs.filter(run_duration__gte=dt.timedelta(milliseconds=f.min_duration_ms))
    if f.min_cost_usd is not None:
        runs = runs.filter(pk__in=_runs_costing_at_least(f.min_cost_usd))
    if f.q:
        runs = runs.filter(search_condition(f.q))
    return runs


def user_condition(value: str) -> Q:
    """A user by exact username, or by numeric id."""
    condition = Q(user__username=value)
    if value.isascii() and value.isdigit() and len(value) < 19:
        condition |= Q(user_id=int(value))
    return condition


def _runs_costing_at_least(usd: Decimal):
    # Unknown cost (NULL) adds nothing: a run whose known cost reaches
    # ``usd`` matches, one with only unknown costs never does (R-COST-1).
    return (
        Message.objects.model_calls()
        .values("run_id")
        .annotate(run_cost=Sum("cost_usd"))
        .filter(run_cost__gte=usd)
        .values("run_id")
    )


# --------------------------------------------------------------------------
# Search: ids and words (q)
# --------------------------------------------------------------------------


def id_range(term: str) -> tuple[uuid.UUID, uuid.UUID] | None:
    """The UUIDs a whole id or an id prefix of at least
    :data:`ID_PREFIX_MIN` hex digits (dashes allowed) covers, as an
    inclusive range that a B-tree index answers; ``None`` otherwise."""
    digits = term.strip().lower().replace("-", "")
    if not (ID_PREFIX_MIN <= len(digits) <= 32 and _HEX.match(digits)):
        return None
    pad = 32 - len(digits)
    return uuid.UUID(digits + "0" * pad), uuid.UUID(digits + "f" * pad)


def search_condition(term: str) -> Expression:
    """Runs a search term ``q`` finds (R-ADM-2): an id or id prefix (run,
    thread, turn), an exact request id or operation id, or the words of the
    run's messages and audit rows."""
    term = term.strip()
    # One IN over the union of what each kind of match finds, each through
    # its own index: an OR of these at the top would make PostgreSQL test
    # every run of the table, newest first, against each of them.
    runs = AgentRun.objects.order_by()
    matches = [runs.filter(request_id=term).values("pk")]
    ids = id_range(term)
    if ids is not None:
        matches += [
            runs.filter(c).values("pk") for c in (Q(pk__range=ids), Q(thread__pk__range=ids), Q(turn_id__range=ids))
        ]
    matches.append(Message.objects.audit().filter(operation_id=term).values("run_id"))
    if ids is None:
        matches.append(Message.objects.filter(words_condition(term, using="default")).values("run_id"))
    return InIdArray(matches)


def words_condition(words: str, *, using: str) -> Q | Expression:
    """Messages whose content, tool name, tool input or declared tool calls
    hold ``words`` (``websearch_to_tsquery`` syntax, ``simple``
    configuration). On the embedded SQLite default: an unindexed
    case-insensitive substring match on the content."""
    if connections[using].vendor != "postgresql":
        return Q(content__icontains=words)
    return MatchesWords(words)


class InIdArray(Expression):
    """``<table>.id = ANY(ARRAY(<subquery>))``: the subquery's ids are
    gathered first (an InitPlan), then the runs are fetched by primary key.
    PostgreSQL estimates a full-text match at thousands of rows whatever the
    word, and for an ``IN`` would then hash-join the whole runs table; an
    array it takes as small, which is what a search usually finds. On
    SQLite: ``IN``."""

    conditional = True
    output_field = BooleanField()

    def __init__(self, querysets: list[QuerySet]):
        super().__init__()
        self.querysets = querysets
        self.pk = F("pk")

    def get_source_expressions(self):
        return [self.pk]

    def set_source_expressions(self, exprs):
        (self.pk,) = exprs

    def _union(self, connection) -> tuple[str, list]:
        parts, params = [], []
        for queryset in self.querysets:
            sql, part_params = queryset.query.get_compiler(connection=connection).as_sql()
            parts.append(f"({sql})")
            params.extend(part_params)
        return " UNION ".join(parts), params

    def as_sql(self, compiler, connection):
        pk_sql, pk_params = compiler.compile(self.pk)
        sub_sql, sub_params = self._union(connection)
        return f"{pk_sql} = ANY(ARRAY({sub_sql}))", [*pk_params, *sub_params]

    def as_sqlite(self, compiler, connection):
        pk_sql, pk_params = compiler.compile(self.pk)
        sub_sql, sub_params = self._union(connection)
        return f"{pk_sql} IN ({sub_sql})", [*pk_params, *sub_params]


class MatchesWords(Expression):
    """``<message table>.search_vector @@ websearch_to_tsquery('simple', words)``.

    ``search_vector`` is a generated column that is no model field (see the
    migration): its table alias is taken from the message's primary key
    column, so the condition also works inside subqueries, where Django
    renames the table (``U0``)."""

    conditional = True
    output_field = BooleanField()

    def __init__(self, words: str):
        super().__init__()
        self.words = words
        self.pk = F("pk")

    def get_source_expressions(self):
        return [self.pk]

    def set_source_expressions(self, exprs):
        (self.pk,) = exprs

    def as_sql(self, compiler, connection):
        pk_sql, params = compiler.compile(self.pk)
        table = pk_sql.rsplit(".", 1)[0]
        return f"{table}.search_vector @@ websearch_to_tsquery('simple', %s)", [*params, self.words]


# --------------------------------------------------------------------------
# The staff run list: newest first, keyset-paginated
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class RunPage:
    """Runs newest first; ``next_before`` is the cursor of the next (older)
    page when ``has_more``."""

    items: list[AgentRun]
    has_more: bool
    next_before: str | None


def run_list_page(filters: RunFilters, *, limit: int = 50, before: str | None = None) -> RunPage:
    """One page of the runs matching ``filters``, newest first, with their
    user and model-call / tool-execution counts (R-ADM-2). ``before`` is the
    ``next_before`` of the previous page. One query.

    Raises:
        InvalidInput: ``limit`` outside 1–200, a malformed cursor, or what
            :func:`filter_runs` raises.
    """
    from .selectors import with_operation_counts

    if not 1 <= limit <= RUN_LIST_MAX:
        raise InvalidInput(f"limit must be between 1 and {RUN_LIST_MAX}", extra={"reason": "bad_limit"})
    runs = filter_runs(AgentRun.objects.select_related("user"), filters)
    if before is not None:
        created_at, run_id = _run_cursor(before)
        runs = runs.filter(Q(created_at__lte=created_at) & (Q(created_at__lt=created_at) | Q(pk__lt=run_id)))
    rows = list(with_operation_counts(runs).order_by("-created_at", "-pk")[: limit + 1])
    has_more = len(rows) > limit
    items = rows[:limit]
    next_before = encode_cursor([items[-1].created_at.isoformat(), str(items[-1].pk)]) if has_more else None
    return RunPage(items=items, has_more=has_more, next_before=next_before)


def _run_cursor(cursor: str) -> tuple[dt.datetime, uuid.UUID]:
    created_at, run_id = decode_cursor(cursor, length=2)
    try:
        parsed = dt.datetime.fromisoformat(created_at)
        if parsed.tzinfo is None:
            raise ValueError("naive")
        return parsed.astimezone(dt.UTC), uuid.UUID(run_id)
    except (TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise InvalidInput("the cursor is malformed", extra={"reason": "bad_cursor"}) from exc


def filters_from(values: dict[str, Any]) -> RunFilters:
    """:class:`RunFilters` from validated query values named as in the API
    (``from``/``to`` may also be given as ``created_from``/``created_to``).

    Raises:
        InvalidInput: an unknown status.
    """
    statuses = values.get("status")
    return RunFilters(
        status=parse_statuses(statuses) if isinstance(statuses, str) or statuses is None else tuple(statuses),
        error_type=values.get("error_type") or None,
        model=values.get("model") or None,
        agent=values.get("agent") or None,
        user=values.get("user") or None,
        created_from=aware(values.get("from") or values.get("created_from")),
        created_to=aware(values.get("to") or values.get("created_to")),
        tool=values.get("tool") or None,
        tool_status=values.get("tool_status") or None,
        rejected=values.get("rejected"),
        min_duration_ms=values.get("min_duration_ms"),
        min_cost_usd=values.get("min_cost_usd"),
        q=(values.get("q") or "").strip() or None,
    )
