"""An admin paginator for tables with millions of rows (R-ADM-1).

Django's changelist asks the paginator for ``count``, which is a full
``COUNT(*)``. On the audit tables that is a sequential scan on every page
view. This paginator answers instead:

- unfiltered list: PostgreSQL's planner estimate of the table size
  (``pg_class.reltuples``) when the table is large, exact count otherwise;
- filtered list: an exact count bounded by :attr:`BOUNDED_COUNT` rows
  (``SELECT COUNT(*) FROM (... LIMIT n)``), so a broad filter never scans
  the whole table; pages past the bound are not offered.

Use with ``show_full_result_count = False`` on the ModelAdmin, which spares
the second, unfiltered count.
"""

from __future__ import annotations

from django.core.paginator import Paginator
from django.db import connections
from django.utils.functional import cached_property

ESTIMATE_ABOVE = 10_000


class EstimatingPaginator(Paginator):
    BOUNDED_COUNT = 10_000
    # A search that stops once it found this many rows (the run list's word
    # search, R-ADM-2) sets it: a count that reaches it means "at least".
    lower_bound_at: int | None = None

    @property
    def count_is_lower_bound(self) -> bool:
        """Whether :attr:`count` is only a lower bound: the search stopped
        when it had found :attr:`lower_bound_at` rows, or the bounded count
        stopped at :attr:`BOUNDED_COUNT`."""
        if self.lower_bound_at is not None and self.count == self.lower_bound_at:
            return True
        query = getattr(self.object_list, "query", None)
        return query is not None and bool(query.where) and self.count >= self.BOUNDED_COUNT

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        query = getattr(queryset, "query", None)
        if query is None:  # a list, not a QuerySet
            return super().count
        if not query.where:
            estimate = self._estimate(queryset)
            if estimate is not None and estimate > ESTIMATE_ABOVE:
                return estimate
        return queryset.order_by()[: self.BOUNDED_COUNT].count()

    @staticmethod
    def _estimate(queryset) -> int | None:
        connection = connections[queryset.db]
        if connection.vendor != "postgresql":
            return None
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass", [queryset.model._meta.db_table]
            )
            row = cursor.fetchone()
        # -1 means "never analysed": no estimate.
        return int(row[0]) if row and row[0] >= 0 else None
