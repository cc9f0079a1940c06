"""``manage.py bench_otel_export`` (issue 38, R-OTEL-1): it prints the
export's spans per second beside its same-work baseline and their ratio,
and leaves the database as it was. Figures only: no timing is asserted."""

from __future__ import annotations

import io
import re

import pytest
from django.core.management import call_command

from audit.models import AgentRun
from conversations.models import Message
from otel_export.models import ExportCursor


@pytest.mark.django_db(transaction=True)
def test_bench_otel_export_prints_product_baseline_and_ratio_and_cleans_up():
    out = io.StringIO()
    call_command("bench_otel_export", runs=3, rows=4, rounds=1, stdout=out)
    text = out.getvalue()
    # 3 runs of 4 rows: 15 spans a pass, the product's and the baseline's.
    assert "3 runs of 4 audit rows (15 spans per pass)" in text
    product = re.search(r"product \(export_closed_runs\):\s+(\d+)", text)
    baseline = re.search(r"baseline \(psycopg, one statement/page\):\s+(\d+)", text)
    assert product and baseline and int(product[1]) > 0 and int(baseline[1]) > 0
    assert re.search(r"ratio product / baseline: \d+\.\d\dx", text)
    assert not AgentRun.objects.exists() and not Message.objects.exists()
    assert not ExportCursor.objects.exists()
