"""API authentication: Django session or ``Authorization: Bearer <token>``."""

from __future__ import annotations

import functools

from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone
from ninja.security import HttpBearer, SessionAuth

from conversations.models import ApiToken
from core.db import execute_prepared, field_converters, model_from_values
from core.errors import PermissionDenied


class BearerTokenAuth(HttpBearer):
    """A per-user API token (issued in the admin or by
    ``manage.py create_api_token``). Only its SHA-256 digest is stored."""

    # Set on the instances of staff-only operations (:func:`staff_auth`).
    staff_message: str | None = None

    def authenticate(self, request, token: str):
        # One prepared statement (every API request makes it: compiling the
        # ORM's join each time cost more than running it, issue 11).
        sql, user_fields, converters = _token_statement()
        found = execute_prepared(sql, [ApiToken.digest(token)])
        if found is None:
            return None
        token_id, last_used_at, *values = found
        user = model_from_values(get_user_model(), user_fields, converters, values)
        if not user.is_active:
            return None
        now = timezone.now()
        # One write per minute at most: the token table is not a hot path.
        if last_used_at is None or (now - last_used_at).total_seconds() > 60:
            ApiToken.objects.filter(pk=token_id).update(last_used_at=now)
        request.user = user
        return _staff_checked(user, self.staff_message)


@functools.cache
def _token_statement() -> tuple[str, list, list]:
    """The token's id and last use and its user's every column, by the
    token's digest (its unique index); the user's fields and their
    converters, to load the user as the ORM would."""
    user_model = get_user_model()
    user_fields = list(user_model._meta.concrete_fields)
    token = ApiToken._meta
    qn = connection.ops.quote_name
    columns = ", ".join(f"u.{qn(f.column)}" for f in user_fields)
    sql = (
        f"SELECT t.{qn(token.pk.column)}, t.{qn(token.get_field('last_used_at').column)}, {columns} "
        f"FROM {qn(token.db_table)} t JOIN {qn(user_model._meta.db_table)} u "
        f"ON u.{qn(user_model._meta.pk.column)} = t.{qn(token.get_field('user').column)} "
        f"WHERE t.{qn(token.get_field('key_digest').column)} = %s"
    )
    return sql, user_fields, field_converters(user_fields, user_model._meta.db_table, connection)


class ActiveSessionAuth(SessionAuth):
    """Session auth (with Django's CSRF check for unsafe methods)."""

    staff_message: str | None = None

    def authenticate(self, request, key):
        user = super().authenticate(request, key)
        if user is not None and not user.is_active:
            return None
        return _staff_checked(user, self.staff_message)


def _staff_checked(user, staff_message: str | None):
    if user is not None and staff_message is not None and not user.is_staff:
        raise PermissionDenied(staff_message)
    return user


def staff_auth(message: str) -> list:
    """The API's authentication for a staff-only operation: a signed-in
    user who is not staff is answered 403 ``forbidden`` with ``message``
    before the request's parameters are read, so a bad query never tells
    them more (a 422 listing the endpoint's inputs); no credentials stay
    401 (R-READ-5). The same schemes as :data:`api_auth` in the OpenAPI
    document."""
    bearer, session = BearerTokenAuth(), ActiveSessionAuth()
    bearer.staff_message = session.staff_message = message
    return [bearer, session]


api_auth = [BearerTokenAuth(), ActiveSessionAuth()]
