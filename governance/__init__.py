"""Data governance (SPEC §6): retention of payloads (R-GOV-1), erasure of
one user's content (R-GOV-2) and sealed runs that prove the audit was not
changed behind the application's back (R-GOV-3).

- ``seal.py``: the hash chain over a run's closed audit rows, computed in
  the terminal transaction (:func:`seal.seal_run`) and recomputed by
  ``verify_audit``;
- ``triggers.py``: the append-only triggers (django-pgtrigger) declared on
  ``AgentRun`` and ``Message``, and the one audited bypass they honour;
- ``services.py``: purge and erasure, in short batches, each recorded as a
  :class:`models.GovernanceAction` and re-sealing what it changed.
"""
