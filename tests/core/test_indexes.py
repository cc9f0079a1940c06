"""The product's tables carry no index that another one makes redundant
(issue 38, the audit's own cost): every index is written with every new
row version, so a single-column index whose column leads a composite
index of the same table costs each write and serves no read the composite
does not. Django gives every foreign key such an index unless told
``db_index=False``; this test finds the next one."""

from __future__ import annotations

import pytest
from django.apps import apps
from django.db import connection

pytestmark = pytest.mark.django_db

#: Apps whose tables the product owns (Django's auth and LangGraph's
#: checkpoint tables are theirs).
PRODUCT_APPS = ("audit", "conversations", "costs", "dashboard", "governance", "otel_export", "webhooks")

REDUNDANT = """
WITH ix AS (
    SELECT i.indexrelid::regclass::text AS name, c.relname AS tbl, i.indisunique AS uniq,
           i.indpred IS NOT NULL AS partial, am.amname AS method,
           (SELECT array_agg(a.attname ORDER BY k.ord)
              FROM unnest(i.indkey) WITH ORDINALITY k(attnum, ord)
              JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum) AS cols
      FROM pg_index i
      JOIN pg_class c ON c.oid = i.indrelid
      JOIN pg_class ic ON ic.oid = i.indexrelid
      JOIN pg_am am ON am.oid = ic.relam
     WHERE c.relname = ANY(%s)
)
SELECT a.tbl, a.name, b.name
  FROM ix a JOIN ix b ON a.tbl = b.tbl AND a.name <> b.name
 WHERE a.method = 'btree' AND b.method = 'btree' AND NOT a.uniq AND NOT a.partial AND NOT b.partial
   AND cardinality(a.cols) < cardinality(b.cols) AND b.cols[1:cardinality(a.cols)] = a.cols
 ORDER BY 1, 2
"""


def test_no_index_of_the_product_is_the_head_of_another_R_SCALE_1():
    tables = [m._meta.db_table for name in PRODUCT_APPS for m in apps.get_app_config(name).get_models()]
    assert "conversations_message" in tables and "audit_agentrun" in tables
    with connection.cursor() as cursor:
        cursor.execute(REDUNDANT, [tables])
        redundant = cursor.fetchall()
    assert redundant == [], "indexes whose columns lead another index of the table (db_index=False): " + ", ".join(
        f"{table}.{index} (covered by {by})" for table, index, by in redundant
    )


def test_the_detector_finds_a_redundant_index_R_SCALE_1():
    """The query itself: a single-column index under a composite is found."""
    with connection.cursor() as cursor:
        cursor.execute("CREATE TEMP TABLE probe_ix (a int, b int)")
        cursor.execute("CREATE INDEX probe_ix_a ON probe_ix (a)")
        cursor.execute("CREATE INDEX probe_ix_ab ON probe_ix (a, b)")
        cursor.execute("CREATE INDEX probe_ix_b_part ON probe_ix (b) WHERE a > 0")
        cursor.execute(REDUNDANT, [["probe_ix"]])
        assert cursor.fetchall() == [("probe_ix", "probe_ix_a", "probe_ix_ab")]
