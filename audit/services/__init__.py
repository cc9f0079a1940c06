"""Writes of run execution: submission, lease, audit rows, terminal state.

Every write that a worker makes into a run is fenced by its lease
(:mod:`audit.lease`), in its own short transaction (R-RUN-4, R-RUN-5): the
lifecycle writes of audit rows as one statement that locks the run row,
checks the lease and writes (:mod:`audit.services.fenced`), the others
under :func:`audit.lease.lock_run`. Functions take keyword-only arguments
and own their transaction.
"""

from .model_audit import model_call_finish, model_call_open, model_call_retry, model_call_start
from .runs import lease_renew, run_acquire, run_request_cancel, run_resume, run_submit, run_sweep_expired_leases
from .terminal import StateMessage, run_finish, run_finish_fallback
from .tool_audit import tool_call_error, tool_call_finish, tool_call_start

__all__ = [
    "StateMessage",
    "lease_renew",
    "model_call_finish",
    "model_call_open",
    "model_call_retry",
    "model_call_start",
    "run_acquire",
    "run_finish",
    "run_finish_fallback",
    "run_request_cancel",
    "run_resume",
    "run_submit",
    "run_sweep_expired_leases",
    "tool_call_error",
    "tool_call_finish",
    "tool_call_start",
]
