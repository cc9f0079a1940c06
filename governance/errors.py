"""Errors of governance commands (the product's one error family)."""

from core.errors import ApplicationError, Conflict, InvalidInput, NotFound


class UnknownUser(NotFound):
    code = "unknown_user"


class RunStillActive(Conflict):
    """The user has a run that is not terminal: erasing now would race its
    worker, so nothing is changed."""

    code = "run_still_active"


class RunActive(Conflict):
    """A thread to delete has a run pending or running (R-API-1): deleting
    it would race its worker; ``?cancel=true`` cancels the run first."""

    code = "run_active"


class GovernanceBusy(Conflict):
    """Another purge or erasure is in progress."""

    code = "governance_busy"


__all__ = ["ApplicationError", "GovernanceBusy", "InvalidInput", "RunActive", "RunStillActive", "UnknownUser"]
