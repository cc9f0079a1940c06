"""The dashboard's series colours (R-DASH-1, issue 37): a palette of many
distinct colours in a static file the page loads before the charts (no
inline script: the CSP is script-src 'self'), used by model for the
stacked token and cost charts. tests/browser draws them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.urls import reverse

STATIC = Path(__file__).resolve().parents[2] / "static" / "dashboard"


def test_the_palette_has_twenty_distinct_hand_picked_colours_issue_37():
    source = (STATIC / "palette.js").read_text()
    listed = re.search(r"COLOURS = \[(.*?)\];", source, re.S).group(1)
    colours = re.findall(r'"(#[0-9a-f]{6})"', listed)
    assert len(colours) == 20 and len(set(colours)) == 20
    # Past the list, colours are computed (golden-angle hues), never repeated by index.
    assert "% COLOURS.length" not in source


def test_the_model_charts_take_their_colours_by_model_from_the_palette_issue_37():
    source = (STATIC / "dashboard.js").read_text()
    assert "PALETTE[i % PALETTE.length]" not in source
    assert source.count("backgroundColor: modelColour[model]") == 2


@pytest.mark.django_db
def test_the_dashboard_page_loads_the_palette_before_the_charts_issue_37(client, staff_user):
    client.force_login(staff_user)
    html = client.get(reverse("admin-dashboard")).content.decode()
    scripts = re.findall(r'<script src="([^"]+)"', html)
    names = [s.rsplit("/", 1)[-1] for s in scripts]
    assert names.index("palette.js") < names.index("dashboard.js")
    assert not re.search(r"<script(?![^>]*\b(src|type=\"application/json\"))[^>]*>", html)
