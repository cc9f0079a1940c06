"""Operations (R-OPS-1): Prometheus metrics (recorded by :mod:`ops.metrics`,
served with the queue gauges by :mod:`ops.exposition`), health and
readiness probes (:mod:`ops.health`), request and run ids on every log line
(:mod:`ops.logcontext`), and their HTTP views (:mod:`ops.views`).

The rest of the product calls this package through one-line hooks; nothing
here ever fails a run or a request because metrics or logging went wrong.
"""
