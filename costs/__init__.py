"""Cost of model calls, runs, users and days, and budgets that stop spending.

* R-COST-1 — :mod:`costs.pricing`: each model row gets its USD cost when it
  closes, from its usage and the genai-prices catalogue (or ``MODEL_PRICES``
  overrides, or the replay models' default prices), with price source and
  version; unknown usage or price gives a null cost, never 0.
* R-COST-2 — :mod:`costs.selectors`: every total (run, thread, user, model,
  day) is a sum over the rows, never a second source of truth.
* R-COST-3 — :mod:`costs.budgets` and :mod:`costs.services`: per-user (or
  default) budgets per day or month; submissions over budget answer 402 and
  create nothing; a running run stops before its next model call.
"""
