"""Webhooks (R-API-3): a run's end announced to the URL its submit or resume
named, signed, from PostgreSQL behind a durable cursor, retried until the
receiver accepts it.

- :mod:`webhooks.targets`: which URLs may be named (``WEBHOOK_ALLOWED_HOSTS``).
- :mod:`webhooks.services`: the cursor that queues a delivery per run end,
  and the delivery passes (claim, sign, POST, record the attempt).
- :mod:`webhooks.tasks`: the beat task; ``manage.py deliver_webhooks``.
"""
