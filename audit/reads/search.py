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
  ``conversations.0004_audit_search``); the query is
  ``websearch_to_tsquery`` syntax: ``"exact phrase"``, ``or``, ``-word``.
  Chinese, Japanese and Korean text is indexed as overlapping bigrams and a
  CJK term searched as the phrase of its bigrams (:func:`search_text`,
  migration ``conversations.0010_cjk_phrase_search``, R-ADM-3): a phrase
  is found inside a sentence, in its order, through the same index.

Filters that look into audit rows are ``run IN (SELECT run_id ...)``
subqueries driven by an index of the message table, so a rare match does
not scan the runs table newest-first.

Words are searched in one of two ways, chosen per term inside the page's one
statement (the planner cannot: its estimate of a word's matches does not
tell how soon the newest runs hold a page of them): a word few rows
hold is gathered from the GIN index (every matching run, then the page); a
word many rows hold, on the run list, is found by walking the list's runs
newest first and probing each run's rows (:class:`PageWalk`), which stops
when the page is full. See :func:`search_condition`.
"""

from __future__ import annotations

import datetime as dt
import re
import uuid
from dataclasses import dataclass, fields, replace
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
from core.cursors import decode_cursor, encode_cursor
from core.errors import InvalidInput

from ..models import AgentRun

RUN_LIST_MAX = 200
# The run list's order: newest first, the id breaking ties. The page query,
# its cursor and the search's walk of the page's runs all follow it.
RUN_LIST_ORDER = ("-created_at", "-pk")
# A word held by at most this many audit rows and messages is gathered from
# the GIN index: at most ~25 ms of heap and run fetches on two cores (1M
# audit rows: ~4 µs a row, ~9 µs a run). Counting up to it is one bounded
# index read (~1–30 ms, a phrase of common words the most).
SEARCH_FEW_ROWS = 2_000
# A word held by more rows is first looked for in this many runs of the page,
# newest first, one index probe of the run's rows each (~10–20 µs): a word in
# one run of 50 fills a page of 50 within ~2,600 runs. When these runs hold
# fewer matches than the page takes, the search gathers as for a rare word
# (the walk wasted: at most ~50–100 ms, plus listing the window's runs).
SEARCH_WALK_RUNS = 5_000
# Hex digits of an id the admin shows (``str(run.id)[:8]``): the shortest
# id prefix the search takes as an id.
ID_PREFIX_MIN = 8
_HEX = re.compile(r"^[0-9a-f]+$")
# Characters of Chinese, Japanese and Korean words: Han, 々 and 〇, kana,
# Hangul. The same class as the SQL function ``audit_search_text`` that
# builds ``search_vector`` (migration conversations.0010_cjk_phrase_search).
CJK_CHARACTERS = (
    "\u1100-\u11ff\u3005\u3007\u3040-\u30ff\u3130-\u318f\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff"
    "\uac00-\ud7af\uf900-\ufaff\uff66-\uff9f\U00020000-\U0002ffff"
)
_CJK_RUN = re.compile(f"([{CJK_CHARACTERS}]+)")
_CJK_INSIDE = re.compile(f"(?<=[{CJK_CHARACTERS}])([{CJK_CHARACTERS}])(?=[{CJK_CHARACTERS}])")
_QUERY_TOKEN = re.compile(r"\S+")


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
    """``"failed,cancelled"`` → ``("failed", "cancelled")``; ``""`` or None
    → ``()`` (no filter). Exactly the schema's pattern: statuses separated
    by single commas, nothing around them (R-READ-6).

    Raises:
        InvalidInput: an unknown or empty status, as in ``"failed,"``
            (``field: status``).
    """
    statuses = tuple(value.split(",")) if value else ()
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
        InvalidInput: ``from`` after ``to``, a time out of range.
    """
    f = filters
    # An empty window (from = to) is asked, and answered with no run; one
    # that ends before it starts is a mistake.
    if f.created_from and f.created_to and f.created_from > f.created_to:
        raise InvalidInput("'from' must not be after 'to'", extra={"field": "from"})
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


@dataclass(frozen=True)
class PageWalk:
    """The runs a page of the run list is taken from, for
    :func:`search_condition`: ``runs`` is a QuerySet of runs with every
    other filter and the cursor applied (no search, any order: the walk
    follows :data:`RUN_LIST_ORDER`); the page takes its first ``size``
    matching runs (the page's limit plus one, to know whether more follow)."""

    runs: QuerySet[AgentRun]
    size: int


def search_condition(term: str, *, walk: PageWalk | None = None) -> Expression:
    """Runs a search term ``q`` finds (R-ADM-2): an id or id prefix (run,
    thread, turn), an exact request id or operation id, or the words of the
    run's messages and audit rows.

    ``walk``: the page the condition is for (the run list). Without it
    (exports, the admin) the words' runs are all gathered from the GIN index
    first. With it, a word more than :data:`SEARCH_FEW_ROWS` rows hold is
    looked for in the first :data:`SEARCH_WALK_RUNS` runs of the page in
    list order; the runs found there are the page's when they fill it or
    when the window held every run of the page's filters (so the condition
    keeps exactly the runs of the page that the plain condition keeps);
    otherwise the words' runs are gathered as without ``walk``."""
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
        if walk is not None and connections["default"].vendor == "postgresql":
            return InIdArray(matches, words=WordsOfPage(term, walk))
        matches.append(Message.objects.filter(words_condition(term, using="default")).values("run_id"))
    return InIdArray(matches)


def search_text(text: str) -> str:
    """``text`` as ``search_vector`` indexes it (the SQL function
    ``audit_search_text``): each run of CJK characters set apart by spaces
    and written as its overlapping bigrams in order (``深度检索`` →
    ``深度 度检 检索``; one character stays as it is). Text without CJK
    characters is returned unchanged."""
    return _CJK_INSIDE.sub(r"\1 \1", _CJK_RUN.sub(r" \1 ", text))


def tsquery_words(words: str) -> str:
    """A search's ``words`` (``websearch_to_tsquery`` syntax) for the
    bigram index (R-ADM-3): a term holding CJK characters becomes the phrase
    of its :func:`search_text` (``请使用深度检索工具`` holds
    ``"深度 度检 检索"``; ``检索深度`` does not), keeping a leading ``-``;
    inside a quoted phrase the text is only transformed, so the phrase
    runs on. Words without CJK characters are returned unchanged."""
    if not _CJK_RUN.search(words):
        return words
    pieces = words.split('"')
    # Even pieces are outside quotes, odd ones inside (an unclosed quote
    # runs to the end, as in websearch_to_tsquery).
    for i, piece in enumerate(pieces):
        pieces[i] = search_text(piece) if i % 2 else _QUERY_TOKEN.sub(_cjk_term_as_phrase, piece)
    return '"'.join(pieces)


def _cjk_term_as_phrase(match: re.Match[str]) -> str:
    term = match.group()
    if not _CJK_RUN.search(term):
        return term
    sign, term = ("-", term[1:]) if term.startswith("-") else ("", term)
    return f'{sign}"{search_text(term).strip()}"'


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

    def __init__(self, querysets: list[QuerySet], *, words: WordsOfPage | None = None):
        super().__init__()
        self.querysets = querysets
        self.words = words
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
        if self.words is None:
            return " UNION ".join(parts), params
        with_sql, with_params, words_parts = self.words.as_sql(connection)
        for sql, part_params in words_parts:
            parts.append(f"({sql})")
            params.extend(part_params)
        return f"{with_sql} " + " UNION ".join(parts), [*with_params, *params]

    def as_sql(self, compiler, connection):
        pk_sql, pk_params = compiler.compile(self.pk)
        sub_sql, sub_params = self._union(connection)
        return f"{pk_sql} = ANY(ARRAY({sub_sql}))", [*pk_params, *sub_params]

    def as_sqlite(self, compiler, connection):
        pk_sql, pk_params = compiler.compile(self.pk)
        sub_sql, sub_params = self._union(connection)
        return f"{pk_sql} IN ({sub_sql})", [*pk_params, *sub_params]


class WordsOfPage:
    """The SQL of :func:`search_condition`'s words for a page (PostgreSQL):
    a ``WITH`` clause, and the parts it adds to :class:`InIdArray`'s union.

    * ``search_few``: whether at most :data:`SEARCH_FEW_ROWS` rows hold the
      words (the index's matches counted, stopping one past the bound);
    * ``search_window``: the first :data:`SEARCH_WALK_RUNS` runs of the page's
      filters, in list order;
    * ``search_walked``: unless the rows are few, the first ``size`` runs of
      the window one of whose rows holds the words (``probe``);
    * the union: the walked runs, and the runs of every row holding the
      words (``search_gathered``, through the GIN index) unless the walk
      settled the page.

    Each decision is an InitPlan gating a whole branch (a one-time filter),
    so the branch not taken costs nothing. The aliases name the branches in
    ``EXPLAIN`` (the tests read them)."""

    def __init__(self, words: str, walk: PageWalk):
        self.words = tsquery_words(words)
        self.walk = walk

    def as_sql(self, connection) -> tuple[str, list, list[tuple[str, list]]]:
        table = connection.ops.quote_name(Message._meta.db_table)
        run_id = connection.ops.quote_name(Message._meta.get_field("run").column)
        matches = "search_vector @@ websearch_to_tsquery('simple', %s)"
        runs = self.walk.runs.order_by(*RUN_LIST_ORDER).values("pk", "created_at")[:SEARCH_WALK_RUNS]
        runs_sql, runs_params = runs.query.get_compiler(connection=connection).as_sql()
        size = int(self.walk.size)
        # The window is a CTE so that its runs are listed once, whether the
        # walk or the count below reads them; a CTE is read back in the
        # order its rows were made (its ORDER BY): the walk's LIMIT keeps
        # the first matches of the list, and stops reading there (an ORDER
        # BY on the CTE would sort, so read, the whole window first).
        # OFFSET 0 keeps the EXISTS a probe of each run's rows (through the
        # message table's run index) in that order: as a semi-join,
        # PostgreSQL could hash every row the GIN index matches first.
        with_sql = f"""WITH search_few AS MATERIALIZED (
                SELECT count(*) <= {SEARCH_FEW_ROWS} AS yes FROM (
                    SELECT 1 FROM {table} search_counted WHERE {matches} LIMIT {SEARCH_FEW_ROWS + 1}) search_hits),
            search_window AS MATERIALIZED ({runs_sql}),
            search_walked AS MATERIALIZED (
                SELECT page.pk FROM ({runs_sql}) page
                WHERE NOT (SELECT yes FROM search_few) AND EXISTS (
                    SELECT 1 FROM {table} probe WHERE probe.{run_id} = page.pk AND probe.{matches} OFFSET 0)
                ORDER BY page.created_at DESC, page.pk DESC
                LIMIT {size})"""
        # Gather unless the walk settled the page: it found the page's runs,
        # or its window held every run of the page's filters. A CASE, so
        # that each InitPlan runs only when the one before did not decide.
        gather = f"""CASE WHEN (SELECT yes FROM search_few) THEN true
                WHEN (SELECT count(*) FROM search_walked) >= {size} THEN false
                ELSE (SELECT count(*) FROM search_window) >= {SEARCH_WALK_RUNS} END"""
        # The gathering branch takes the words as an InitPlan's value, not a
        # constant: PostgreSQL then prices it at its default selectivity, not
        # at the word's frequency. It runs only for words few rows hold (or
        # when the walk comes up short), and a price of a common word's
        # hundreds of thousands of rows would switch on JIT compilation for
        # the whole statement (~200 ms) while the branch does not even run.
        gathered = "search_vector @@ (SELECT websearch_to_tsquery('simple', %s))"
        parts = [
            ("SELECT pk FROM search_walked", []),
            (f"SELECT {run_id} FROM {table} search_gathered WHERE {gathered} AND {gather}", [self.words]),
        ]
        return with_sql, [self.words, *runs_params, *runs_params, self.words], parts


class MatchesWords(Expression):
    """``<message table>.search_vector @@ websearch_to_tsquery('simple', words)``,
    ``words`` written for the bigram index (:func:`tsquery_words`).

    ``search_vector`` is a generated column that is no model field (see the
    migration): its table alias is taken from the message's primary key
    column, so the condition also works inside subqueries, where Django
    renames the table (``U0``)."""

    conditional = True
    output_field = BooleanField()

    def __init__(self, words: str):
        super().__init__()
        self.words = tsquery_words(words)
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
    runs = filter_runs(AgentRun.objects.select_related("user"), replace(filters, q=None))
    if before is not None:
        created_at, run_id = _run_cursor(before)
        runs = runs.filter(Q(created_at__lte=created_at) & (Q(created_at__lt=created_at) | Q(pk__lt=run_id)))
    if filters.q:
        # Last, so that a common word is looked for among the runs that
        # every other filter and the cursor keep, page by page.
        runs = runs.filter(search_condition(filters.q, walk=PageWalk(runs, limit + 1)))
    rows = list(with_operation_counts(runs).order_by(*RUN_LIST_ORDER)[: limit + 1])
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
