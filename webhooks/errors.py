"""Errors of webhooks (the product's one error family)."""

from core.errors import PermissionDenied


class WebhookNotAllowed(PermissionDenied):
    """A ``webhook`` on a host the server will not call (R-API-3): outside
    ``WEBHOOK_ALLOWED_HOSTS`` (``reason: host_not_allowed``), or webhooks
    not configured (``reason: not_configured``). 403; nothing is created."""

    code = "webhook_not_allowed"


__all__ = ["WebhookNotAllowed"]
