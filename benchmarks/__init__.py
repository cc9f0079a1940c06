"""The product's benchmarks, behind thin management commands: each prints
its figures beside the same work done without the product, and
``manage.py performance_report`` runs them at short sizes and writes
``docs/performance.md`` (see that page; targets are checked by these
figures, never by timed assertions).

- :mod:`benchmarks.audit_writes`: a lease-checked audit write against raw
  SQL, with its metrics (R-OPS-1) and its cost (R-COST-1),
  ``bench_audit_writes``;
- :mod:`benchmarks.run_overhead`: a whole run against the bare graph and
  LangGraph's own checkpointer, ``bench_run_overhead``;
- :mod:`benchmarks.seal`: what the seal adds to the terminal transaction
  (R-GOV-3), ``bench_seal``;
- :mod:`benchmarks.purge`: the payload purge against the same work done by
  hand, re-seal included (R-GOV-1, issue 38), ``bench_purge``;
- :mod:`benchmarks.otel_export`: the OpenTelemetry export against the same
  rows read and sent without the product (R-OTEL-1, issue 38),
  ``bench_otel_export``;
- :mod:`benchmarks.read_paths`: every read endpoint over a large audit
  against its best SQL (R-READ-1, R-ADM-1, R-ADM-2, R-DASH-1),
  ``bench_read_paths``;
- :mod:`benchmarks.dashboard`: the dashboard over a month of rollups
  (R-DASH-1), ``bench_dashboard``;
- :mod:`benchmarks.report`: the performance page from their results;
  :mod:`benchmarks.figures`: the arithmetic they share;
  :mod:`benchmarks.databases`: databases of their own.

The top of the layers: a benchmark may import any module of the product,
and no module of the product imports a benchmark (import-linter contract
``benchmarks-apart``).
"""
