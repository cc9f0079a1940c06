"""Errors of run execution and the audit path (R-RUN-4, R-RUN-8, R-MA-3)."""

from __future__ import annotations

from core.errors import ApplicationError, Conflict


class LeaseError(Conflict):
    """A write was refused because the caller does not own the run now.

    The worker that gets one stops the run: no further model step starts.
    """

    code = "lease_error"


class RunIdentityMismatch(LeaseError):
    """The run id, request id or thread id in the lease does not match the row."""

    code = "run_identity_mismatch"


class LeaseLost(LeaseError):
    """Another owner or a newer fencing token holds the run."""

    code = "lease_lost"


class LeaseExpired(LeaseLost):
    """The caller's lease expired before this write (R-RUN-7)."""

    code = "lease_expired"


class RunTerminal(LeaseError):
    """The run already ended; nothing may be written into it."""

    code = "run_terminal"


class RunNotStartable(LeaseError):
    """Acquisition refused: the run is not pending (already started, leased
    by a live owner, or ended) — e.g. a second Celery delivery (R-RUN-3)."""

    code = "run_not_startable"


class AuditConflict(Conflict):
    """A lifecycle event contradicts what the audit already holds: the same
    operation with another sequence, a key change inside one lifecycle, or a
    different result for a closed row (R-MA-3, R-MA-5, R-TA-2)."""

    code = "audit_conflict"


class AuditWriteFailed(ApplicationError):
    """A critical audit write kept failing (database unreachable); the run
    fails with this error type (R-RUN-8)."""

    code = "audit_write_failed"
    http_status = 503


class AuditWriteRejected(ApplicationError):
    """The database refused an audit write for good (``DataError``, a value
    it cannot hold, a refused encoding: retrying cannot help). The run fails
    at once with the error type ``audit_write_rejected:<cause>``, e.g.
    ``audit_write_rejected:DataError``, ended by the minimal fallback
    terminal transaction when its own terminal write is refused (R-RUN-11).
    """

    code = "audit_write_rejected"
    http_status = 500

    def __init__(self, message: str = "", *, cause: str, extra: dict | None = None):
        super().__init__(message, extra={"cause": cause, **(extra or {})})
        self.cause = cause
        # The run's error type names the cause.
        self.code = f"{type(self).code}:{cause}"[:100]


class RunBusy(ApplicationError):
    """A web request gave up waiting for a run or thread row that a worker
    holds (R-RUN-10); nothing was changed, the client may retry."""

    code = "run_busy"
    http_status = 503


class DatabaseUnavailable(ApplicationError):
    """PostgreSQL could not be reached when a worker picked a run up; the
    task is retried and the run stays ``pending`` (R-RUN-9)."""

    code = "database_unavailable"
    http_status = 503


class ToolResultConflict(AuditConflict):
    """A tool lifecycle tried to close an already closed tool row with a
    different result (R-TA-2). The same result again is a no-op instead."""

    code = "tool_result_conflict"


class RunNotResumable(Conflict):
    """Resume refused: the run is not ``interrupted``, or it was already
    resumed by another request (R-TA-5); then ``extra`` names the
    ``resumed_by`` run."""

    code = "run_not_resumable"


class RunNotCancellable(Conflict):
    """Cancel refused: the run already ended ``completed``, ``failed`` or
    ``interrupted`` and resumed, so there is nothing to stop (R-RUN-6).
    ``extra`` names the run's ``status`` and, for a resumed run, the
    ``resumed_by`` run to cancel instead. A cancelled run is not refused: a
    cancel repeated is answered with the run as it is."""

    code = "run_not_cancellable"


class ThreadInterrupted(Conflict):
    """A new turn refused: a run of the thread waits for an approval and
    holds the thread until it is resumed or cancelled (R-TA-5). ``extra``
    names that ``run_id`` (and ``reason: thread_interrupted``, the code's
    earlier place). Nothing was changed."""

    code = "thread_interrupted"


class ThreadBusy(Conflict):
    """A new turn refused with ``multitask_strategy: reject``: a run of the
    thread is pending or running (R-API-2). ``extra`` names them in
    ``runs``. Nothing was changed."""

    code = "thread_busy"


class RequestIdReused(Conflict):
    """The caller already used this idempotency key for a different request:
    another thread or run, other input, or a turn's key sent as a resume and
    the reverse (R-IDEM-1). Nothing was changed."""

    code = "request_id_reused"
