"""One error family for the whole product, mapped to HTTP in one place
(``yuxi_project.api``). Every error has a stable machine-readable ``code``."""

from __future__ import annotations

from typing import Any


class ApplicationError(Exception):
    """Base of every error the product raises on purpose.

    ``code`` is the machine-readable name clients and the run's
    ``error_type`` use; ``http_status`` is what the API answers.
    """

    code = "application_error"
    http_status = 400

    def __init__(self, message: str = "", *, extra: dict[str, Any] | None = None):
        super().__init__(message or self.code)
        self.message = message or self.code
        self.extra = extra or {}


class InvalidInput(ApplicationError):
    code = "invalid_input"
    http_status = 422


class NotFound(ApplicationError):
    code = "not_found"
    http_status = 404


class PermissionDenied(ApplicationError):
    code = "permission_denied"
    http_status = 403


class Conflict(ApplicationError):
    code = "conflict"
    http_status = 409
