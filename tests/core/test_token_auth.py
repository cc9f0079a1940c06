"""Bearer token authentication of the JSON APIs: one prepared statement per
request (issue 11), with the rules it had as an ORM query — unknown tokens
and inactive users are refused, the user is loaded as the ORM loads it, and
the token's last use is written at most once a minute."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection
from django.test import Client, RequestFactory
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from conversations.models import ApiToken
from yuxi_project.auth import BearerTokenAuth

pytestmark = pytest.mark.django_db


def _authenticate(plaintext: str):
    return BearerTokenAuth().authenticate(RequestFactory().get("/api/threads"), plaintext)


def test_a_token_authenticates_its_user_loaded_as_the_orm_loads_it(staff_user):
    token, plaintext = ApiToken.objects.issue(user=staff_user, name="t")
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now())
    with CaptureQueriesContext(connection) as queries:
        user = _authenticate(plaintext)
    assert len(queries) == 1, [q["sql"] for q in queries]
    orm = type(staff_user).objects.get(pk=staff_user.pk)
    for f in type(orm)._meta.concrete_fields:
        ours, theirs = getattr(user, f.attname), getattr(orm, f.attname)
        assert (ours, type(ours)) == (theirs, type(theirs)), f.name
        if isinstance(theirs, dt.datetime):
            assert ours.tzinfo is theirs.tzinfo, f.name
    assert user._state.adding is False and user._state.db == orm._state.db


def test_unknown_tokens_and_inactive_users_are_refused(user):
    assert _authenticate("not-a-token") is None
    _, plaintext = ApiToken.objects.issue(user=user, name="t")
    assert _authenticate(plaintext) == user
    type(user).objects.filter(pk=user.pk).update(is_active=False)
    assert _authenticate(plaintext) is None
    response = Client().get("/api/threads", headers={"Authorization": f"Bearer {plaintext}"})
    assert response.status_code == 401


def test_the_last_use_is_written_at_most_once_a_minute(user):
    token, plaintext = ApiToken.objects.issue(user=user, name="t")
    assert token.last_used_at is None
    _authenticate(plaintext)
    first = ApiToken.objects.get(pk=token.pk).last_used_at
    assert first is not None
    with CaptureQueriesContext(connection) as queries:
        _authenticate(plaintext)
    assert len(queries) == 1 and ApiToken.objects.get(pk=token.pk).last_used_at == first
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=first - dt.timedelta(minutes=2))
    _authenticate(plaintext)
    assert ApiToken.objects.get(pk=token.pk).last_used_at > first
