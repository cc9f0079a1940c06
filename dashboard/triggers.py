"""Active users of a window without reading a row per user (R-DASH-1).

A user is active in a UTC hour when :class:`~dashboard.models.RollupUserHour`
holds a row of that hour with ``user_messages > 0`` for them. The users
active in a window are not a sum of per-hour or per-day counts (a user
active twice is one user), but each of them has exactly one *first* active
hour in the window: the one whose previous active hour of the same user
lies before the window's start (or does not exist). So with each active
hour row linked to its user's previous active hour
(``previous_active_hour``), the users active in ``[start, end)`` are the
links of the window's hours whose previous hour is before ``start``.

The database counts the links, so the dashboard reads a few rows per hour
or day, however many users there are:

* :class:`~dashboard.models.RollupActiveHour`: links per ``(hour,
  since)``, for the window's edge hours (in Asia/Shanghai, 8 hours before
  its first UTC midnight and 16 after its last);
* :class:`~dashboard.models.RollupActiveDay`: per ``(day, since)`` the
  links of each user's first active hour of a UTC day (``since`` before
  the day), for its whole UTC days: a user's first active hour of the
  window, in a whole day, is their first of that day.

A day or hour has a row per distinct ``since`` of its users (when they
were last active): bounded by the hours of the history, not by the users.

Statement triggers on ``dashboard_rollupuserhour``, over their transition
tables, keep both, in the transaction that changes the hour rows (a run's
end, the rebuild, a user deleted with their rows, a raw ``INSERT`` in a
benchmark; TRUNCATE empties the counts):

* where the statement made hours of a user active or inactive (its
  *flips*), the user's links between their last active hour before the
  first flip and the first after the last one are recomputed from the rows
  and rewritten where they differ (an UPDATE of ``previous_active_hour``
  whose own triggers count nothing);
* the counts then get the net change of the statement's row versions of
  active hours (``+1`` written, ``-1`` replaced) and of the links
  rewritten, by ``(hour, since)`` and, for a user's first hour of a day,
  by ``(day, since)``, one grouped upsert per table in key order. A new
  hour is counted once, with its link: never as a user's first hour and
  then moved, which would make every first run of an hour of every user
  wait on that one row. The INSERT and UPDATE triggers of one upsert each
  count their own rows, and add up in either order.

A run's end in an hour its user was already active in changes neither
activity nor links: each trigger stops at its first test.

Two transactions changing hours of the same user would each see the
other's hours missing and link both to the same earlier hour: the trigger
takes a transaction-level advisory lock per user (in user order) before it
reads the user's hours, and under READ COMMITTED (it refuses to relink
under any other level) its next statement sees what the other committed. A
statement flipping more than :data:`MAX_USER_LOCKS` users (a rebuild's
hour, a benchmark's fill) locks the hour rows against every other writer
instead. A run's end waits for these locks no longer than for a rollup row
(its lock limit, ``ROLLUP_LOCK_WAIT_MS``; a deadlock the same), then is
rolled up later.

Definitions only (the models declare them, so their migrations own them).
"""

from __future__ import annotations

import pgtrigger

USER_HOUR_TABLE = "dashboard_rollupuserhour"
ACTIVE_HOUR_TABLE = "dashboard_rollupactivehour"
ACTIVE_DAY_TABLE = "dashboard_rollupactiveday"
# First key of pg_advisory_xact_lock(int, int) for "a user's active hours";
# the two-key space is apart from the one-key locks of the exporter, the
# purge and the digests.
ACTIVE_LOCK_SPACE = 5_110_301


def _is_active(alias: str = "") -> str:
    """SQL: the hour row (of ``alias``) is an hour in which its user was active."""
    return f"{alias}{'.' if alias else ''}user_messages > 0"


def _first_of_day(hour: str, since: str) -> str:
    """SQL: the active hour ``hour`` is its user's first of its UTC day."""
    return f"({since} IS NULL OR ({since} AT TIME ZONE 'UTC')::date < ({hour} AT TIME ZONE 'UTC')::date)"


def _count(counted: str) -> str:
    """Add ``counted`` (SQL of ``(hour, since, delta)``) to the link counts:
    the net change per key (keys whose changes cancel out are not
    written), in key order, the hour table first, as every transaction
    writing them does."""
    return "".join(
        f"""
        INSERT INTO {table} ({bucket}, since, users)
        SELECT {of}, since, SUM(delta) FROM ({counted}) counted{where}
        GROUP BY 1, 2 HAVING SUM(delta) <> 0 ORDER BY 1, 2
        ON CONFLICT ({bucket}, since) DO UPDATE SET users = {table}.users + EXCLUDED.users;"""
        for table, bucket, of, where in (
            (ACTIVE_HOUR_TABLE, "hour", "hour", ""),
            (ACTIVE_DAY_TABLE, "day", "(hour AT TIME ZONE 'UTC')::date", f" WHERE {_first_of_day('hour', 'since')}"),
        )
    )


# A statement flipping more users than this locks the hour rows against
# every other writer (SHARE ROW EXCLUSIVE, what the rebuild holds anyway)
# instead of taking a lock per user: each advisory lock takes a slot of the
# server's shared lock table (max_locks_per_transaction x connections).
MAX_USER_LOCKS = 256
# Set (transaction-local) while the trigger rewrites links: that UPDATE's
# own triggers count nothing, its writer counts its moves.
RELINKING = "yuxi.relinking_active_hours"


def _links(*, changed: str, counted: str, flips: str) -> str:
    """The body of a statement trigger on the hour rows: stop unless
    ``changed`` (SQL, a condition), and inside the trigger's own rewrite of
    links; count ``counted`` (SQL of ``(hour, since, delta)``, the
    statement's row versions) and, where ``flips`` (SQL of ``(user_id,
    hour)``) holds rows, first relink their users and count the moves with
    them, so that only net changes are written (a new hour is not counted
    as a user's first and then moved: every first run of an hour would
    wait on that one row)."""
    moves = (
        "SELECT hour, since, 1 FROM unnest(moved_hours, moved_to) m(hour, since)"
        " UNION ALL SELECT hour, since, -1 FROM unnest(moved_hours, moved_from) m(hour, since)"
    )
    return f"""
        IF NOT ({changed}) OR current_setting('{RELINKING}', true) = 'on' THEN
            RETURN NULL;
        END IF;
        IF NOT EXISTS (SELECT 1 FROM ({flips}) flips) THEN
            {_count(counted)}
            RETURN NULL;
        END IF;
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            RAISE EXCEPTION 'the hours of active users are linked under READ COMMITTED only, not %',
                current_setting('transaction_isolation');
        END IF;
        IF (SELECT COUNT(DISTINCT user_id) FROM ({flips}) flips) > {MAX_USER_LOCKS} THEN
            LOCK TABLE {USER_HOUR_TABLE} IN SHARE ROW EXCLUSIVE MODE;
        ELSE
            PERFORM pg_advisory_xact_lock({ACTIVE_LOCK_SPACE}, user_id)
            FROM (SELECT DISTINCT user_id FROM ({flips}) flips ORDER BY user_id) users;
        END IF;
        PERFORM set_config('{RELINKING}', 'on', true);
        WITH touched AS (SELECT user_id, MIN(hour) AS first, MAX(hour) AS last FROM ({flips}) flips GROUP BY user_id),
        bounds AS (
            SELECT t.user_id,
                (SELECT MAX(a.hour) FROM {USER_HOUR_TABLE} a
                 WHERE a.user_id = t.user_id AND a.hour < t.first AND {_is_active("a")}) AS lo,
                (SELECT MIN(a.hour) FROM {USER_HOUR_TABLE} a
                 WHERE a.user_id = t.user_id AND a.hour > t.last AND {_is_active("a")}) AS hi
            FROM touched t
        ),
        links AS (
            SELECT a.id, a.hour, LAG(a.hour) OVER (PARTITION BY a.user_id ORDER BY a.hour) AS since,
                a.previous_active_hour AS was, b.lo
            FROM bounds b JOIN {USER_HOUR_TABLE} a ON a.user_id = b.user_id AND {_is_active("a")}
            AND a.hour >= COALESCE(b.lo, '-infinity'::timestamptz) AND a.hour <= COALESCE(b.hi, 'infinity'::timestamptz)
        ),
        moved AS (
            UPDATE {USER_HOUR_TABLE} a SET previous_active_hour = l.since FROM links l
            WHERE a.id = l.id AND (l.lo IS NULL OR l.hour > l.lo) AND a.previous_active_hour IS DISTINCT FROM l.since
            RETURNING l.hour, l.was, l.since
        )
        SELECT array_agg(hour), array_agg(was), array_agg(since) INTO moved_hours, moved_from, moved_to FROM moved;
        PERFORM set_config('{RELINKING}', 'off', true);
        {_count(f"{counted} UNION ALL {moves}")}
        RETURN NULL;"""


_DECLARE = [("moved_hours", "timestamptz[]"), ("moved_from", "timestamptz[]"), ("moved_to", "timestamptz[]")]


def _counted(rows: str, delta: int) -> str:
    return f"SELECT hour, previous_active_hour AS since, {delta} AS delta FROM {rows} WHERE {_is_active()}"


def _active(rows: str) -> str:
    return f"SELECT user_id, hour FROM {rows} WHERE {_is_active()}"


user_hours_insert = pgtrigger.Trigger(
    name="user_hours_insert",
    level=pgtrigger.Statement,
    when=pgtrigger.After,
    operation=pgtrigger.Insert,
    referencing=pgtrigger.Referencing(new="inserted"),
    declare=_DECLARE,
    func=_links(
        changed=f"EXISTS ({_active('inserted')})",
        counted=_counted("inserted", 1),
        flips=_active("inserted"),
    ),
)

# A run's end adds to its user's hour with INSERT … ON CONFLICT DO UPDATE:
# in an hour the user was already active in, one read of the statement's
# own row versions, and nothing else.
user_hours_update = pgtrigger.Trigger(
    name="user_hours_update",
    level=pgtrigger.Statement,
    when=pgtrigger.After,
    operation=pgtrigger.Update,
    referencing=pgtrigger.Referencing(old="before_rows", new="after_rows"),
    declare=_DECLARE,
    func=_links(
        changed="EXISTS (SELECT 1 FROM after_rows n FULL JOIN before_rows o ON o.id = n.id"
        f" WHERE ({_is_active('n')}, n.hour, n.user_id, n.previous_active_hour)"
        f" IS DISTINCT FROM ({_is_active('o')}, o.hour, o.user_id, o.previous_active_hour))",
        counted=f"{_counted('after_rows', 1)} UNION ALL {_counted('before_rows', -1)}",
        flips=f"({_active('after_rows')} EXCEPT {_active('before_rows')})"
        f" UNION ({_active('before_rows')} EXCEPT {_active('after_rows')})",
    ),
)

user_hours_delete = pgtrigger.Trigger(
    name="user_hours_delete",
    level=pgtrigger.Statement,
    when=pgtrigger.After,
    operation=pgtrigger.Delete,
    referencing=pgtrigger.Referencing(old="deleted"),
    declare=_DECLARE,
    func=_links(
        changed=f"EXISTS ({_active('deleted')})",
        counted=_counted("deleted", -1),
        flips=_active("deleted"),
    ),
)

# TRUNCATE fires no row or DELETE trigger: the counts go with the rows.
user_hours_truncate = pgtrigger.Trigger(
    name="user_hours_truncate",
    level=pgtrigger.Statement,
    when=pgtrigger.After,
    operation=pgtrigger.Truncate,
    func=f"DELETE FROM {ACTIVE_HOUR_TABLE}; DELETE FROM {ACTIVE_DAY_TABLE}; RETURN NULL;",
)

#: Declared on ``RollupUserHour``.
USER_HOUR_TRIGGERS = [user_hours_insert, user_hours_update, user_hours_delete, user_hours_truncate]

#: The links rewritten from the hour rows (a rebuild's last step, with the
#: hour rows locked): each active hour's previous active hour of its user.
LINKS_REWRITE_SQL = (
    f"UPDATE {USER_HOUR_TABLE} a SET previous_active_hour = l.since FROM (SELECT id,"
    f" LAG(hour) OVER (PARTITION BY user_id ORDER BY hour) AS since FROM {USER_HOUR_TABLE} WHERE {_is_active()}) l"
    " WHERE a.id = l.id AND a.previous_active_hour IS DISTINCT FROM l.since"
)
#: The link counts recomputed from the links: table -> INSERT of its rows.
LINK_COUNTS_SQL = {
    ACTIVE_HOUR_TABLE: (
        f"INSERT INTO {ACTIVE_HOUR_TABLE} (hour, since, users) SELECT hour, previous_active_hour, COUNT(*)"
        f" FROM {USER_HOUR_TABLE} WHERE {_is_active()} GROUP BY 1, 2"
    ),
    ACTIVE_DAY_TABLE: (
        f"INSERT INTO {ACTIVE_DAY_TABLE} (day, since, users) SELECT (hour AT TIME ZONE 'UTC')::date,"
        f" previous_active_hour, COUNT(*) FROM {USER_HOUR_TABLE}"
        f" WHERE {_is_active()} AND {_first_of_day('hour', 'previous_active_hour')} GROUP BY 1, 2"
    ),
}
