"""Run execution in the worker (SPEC §4–5: R-RUN-*, R-MA-*, R-TA-*,
R-EVT-1, R-SUB-1): a run from its lease to its terminal transaction.

- :mod:`.runner`: one run, leased, streamed and finished (``run_execute``);
- :mod:`.recorder`: the v3 event stream's lifecycle events → audit writes;
- :mod:`.model_requests`: the model row opened at request start;
- :mod:`.checkpoint`: LangGraph's PostgreSQL checkpointer, reconnecting;
- :mod:`.events`: live events in Redis and the SSE stream that reads them;
- :mod:`.worker_loop`: the worker thread's event loop and kept connections;
- :mod:`.dispatch`: pending runs handed (again) to the broker;
- :mod:`.tracing`: the run's OpenTelemetry trace.

Layer two of ``docs/architecture.md#layers`` with the agents
(``audit.agents``) and the replay model server (``audit.replay``): it may
import the audit ledger (``audit.ledger``, ``audit.ledger.lease``, …), the
reads, the models and the foundation; only the interfaces (the Celery
tasks, the API) and the benchmarks import it.
"""
