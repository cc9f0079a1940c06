"""Process tuning of the long-lived processes: the web server (issue 11,
read paths), the Celery worker and the export and webhook loops (issue 38:
the audit's CPU per run, the export's spans per second).

A page of a timeline or of the admin allocates tens of thousands of objects;
with CPython's default thresholds the collector runs several times per
request and now and then walks the whole heap — which after start-up is
mostly Django, the models and the libraries, none of it garbage. That made
the slow tail of the read endpoints (p95 up to twice the median at 1M audit
rows), and in the worker a share of every run's CPU. :func:`tune_gc` is
called once the application is loaded: by ``asgi.py`` and ``wsgi.py``, by
the Celery worker before it starts its pool (``yuxi_project.celery``: the
pool processes inherit it), and by ``export_otel`` and
``deliver_webhooks``."""

from __future__ import annotations

import gc

# A young collection after 50,000 new objects instead of 700: a few per
# large page instead of hundreds; the older generations keep their ratios.
GC_THRESHOLDS = (50_000, 20, 20)


_tuned = False


def tune_gc() -> None:
    """Move everything loaded so far out of the collector's sight
    (``gc.freeze``: start-up objects live as long as the process) and raise
    the young generation's threshold. Call it after the application is
    loaded; it acts once per process (later calls do nothing, so a loop may
    call it after each pass); cyclic garbage is still collected."""
    global _tuned
    if _tuned:
        return
    _tuned = True
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
