"""The audit ledger: every write of a run — submission, lease, audit rows,
terminal state — and what hands it on (R-RUN-1…R-RUN-10, R-MA-*, R-TA-*).

Every write that a worker makes into a run is fenced by its lease
(:mod:`.lease`), in its own short transaction (R-RUN-4, R-RUN-5): the
lifecycle writes of audit rows as one statement that locks the run row,
checks the lease and writes (:mod:`.fenced`), the others under
:func:`.lease.lock_run`. Functions take keyword-only arguments and own
their transaction.

- :mod:`.runs`: submit, resume, acquire, renew, cancel, sweep;
- :mod:`.model_audit`, :mod:`.tool_audit`: the model and tool rows;
- :mod:`.terminal`: the terminal transaction (final State, closed rows,
  output, usage, cost, seal, rollups, lease released);
- :mod:`.trace`: the run's trace ids;
- :mod:`.lease`, :mod:`.fenced`: the fencing token and the fenced write;
- :mod:`.idempotency`: request ids and fingerprints;
- :mod:`.locks`: bounded lock waits for web requests;
- :mod:`.turns`: a thread's turns in order: the runs that hold it, its head;
- :mod:`.handover`: the broker message that starts a run (sent by name);
- :mod:`.cancellation`: the Redis cancel signal;
- :mod:`.causes`: a failure's cause left in Redis for the sweeper.

Layer three of ``docs/architecture.md#layers``, with the services of the
other apps: it may import the reads, the models and the foundation (and
Celery's app, to send a task by name); the run execution, the interfaces
and the benchmarks import it.
"""

from .model_audit import model_call_finish, model_call_open, model_call_retry, model_call_start
from .runs import lease_renew, run_acquire, run_request_cancel, run_resume, run_submit, run_sweep_expired_leases
from .terminal import StateMessage, run_finish, run_finish_fallback, run_hand_over
from .tool_audit import (
    EffectCheck,
    tool_call_error,
    tool_call_finish,
    tool_call_start,
    tool_effect_check,
    tool_effect_recorded,
    tool_effect_skip,
)

__all__ = [
    "EffectCheck",
    "StateMessage",
    "lease_renew",
    "model_call_finish",
    "model_call_open",
    "model_call_retry",
    "model_call_start",
    "run_acquire",
    "run_finish",
    "run_finish_fallback",
    "run_hand_over",
    "run_request_cancel",
    "run_resume",
    "run_submit",
    "run_sweep_expired_leases",
    "tool_call_error",
    "tool_call_finish",
    "tool_call_start",
    "tool_effect_check",
    "tool_effect_recorded",
    "tool_effect_skip",
]
