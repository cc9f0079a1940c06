"""API authentication: Django session or ``Authorization: Bearer <token>``."""

from __future__ import annotations

from django.utils import timezone
from ninja.security import HttpBearer, SessionAuth

from conversations.models import ApiToken


class BearerTokenAuth(HttpBearer):
    """A per-user API token (issued in the admin or by
    ``manage.py create_api_token``). Only its SHA-256 digest is stored."""

    def authenticate(self, request, token: str):
        row = ApiToken.objects.select_related("user").filter(key_digest=ApiToken.digest(token)).first()
        if row is None or not row.user.is_active:
            return None
        now = timezone.now()
        # One write per minute at most: the token table is not a hot path.
        if row.last_used_at is None or (now - row.last_used_at).total_seconds() > 60:
            ApiToken.objects.filter(pk=row.pk).update(last_used_at=now)
        request.user = row.user
        return row.user


class ActiveSessionAuth(SessionAuth):
    """Session auth (with Django's CSRF check for unsafe methods)."""

    def authenticate(self, request, key):
        user = super().authenticate(request, key)
        if user is not None and not user.is_active:
            return None
        return user


api_auth = [BearerTokenAuth(), ActiveSessionAuth()]
