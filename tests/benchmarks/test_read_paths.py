"""``manage.py bench_read_paths`` on a tiny dataset: it builds the data in
its own database, measures every endpoint (each answers 200 on the data it
built) and prints the table; figures are printed, never asserted
(issue 11)."""

from __future__ import annotations

import io
import re

import pytest
from django.core.management import call_command
from django.db import connection

from benchmarks.read_paths import sizes

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_bench_read_paths_builds_measures_and_prints_every_endpoint():
    name = f"{connection.settings_dict['NAME']}_readbench"
    out = io.StringIO()
    call_command("bench_read_paths", rows=2000, rounds=1, repeat=1, database=name, rebuild=True, drop=True, stdout=out)
    text = out.getvalue()
    shape = sizes(2000)
    assert re.search(r"dataset: [\d,]+ audit rows", text), text
    for endpoint in (
        "run timeline",
        "export,",
        "thread timeline",
        "history",
        "memory",
        "search: q=",
        "dashboard overview",
        "admin run page",
        "admin run list",
    ):
        assert endpoint in text, endpoint
    assert shape["big"] < 2000 and "p50/SQL" in text
    # The test database is the default again, and the bench database is gone.
    assert connection.settings_dict["NAME"] != name
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_database WHERE datname = %s", [name])
        assert cursor.fetchone()[0] == 0
