"""The audit's reads (R-READ-3, R-READ-4, R-ADM-1, R-ADM-2, R-TA-5):
shared by the API, the admin, the export and the live events.

- :mod:`.selectors`: a run, its timeline rows, its approval, its live
  state, operation counts;
- :mod:`.search`: run filters and full-text search over the audit.

Layer four of ``docs/architecture.md#layers``, with each app's
selectors: it may import the models and the foundation (and the other
apps' selectors, such as the cost totals); the ledger, the run execution,
the interfaces and the benchmarks import it, and it writes nothing.
"""
