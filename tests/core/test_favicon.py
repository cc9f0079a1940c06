"""The product's icon: named by the admin's and the chat's pages, and
served at /favicon.ico for the pages that name none (the API's docs),
which answered 404 in every browser console."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db

ICON = "/static/yuxi/favicon.svg"


def test_favicon_ico_leads_to_the_icon(client):
    response = client.get("/favicon.ico")
    assert response.status_code == 301 and response["Location"] == ICON
    icon = client.get(ICON)
    assert icon.status_code == 200 and icon["Content-Type"].startswith("image/svg+xml")
    assert b"<svg" in b"".join(icon.streaming_content)


@pytest.mark.parametrize("page", ["/admin/login/", "/chat/login/"])
def test_the_pages_name_the_icon(client, page):
    response = client.get(page)
    assert response.status_code == 200
    assert f'<link rel="icon" href="{ICON}" type="image/svg+xml">' in response.content.decode()
