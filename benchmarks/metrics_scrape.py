"""What a ``/metrics`` scrape costs against prometheus-client's own
exposition of the same directory (``python manage.py bench_metrics``,
R-OPS-1, issue 38).

Writes the multiprocess files that processes which ended and processes
still running would leave, with ``models`` model names and ``tools`` tool
names in the labels (every counter and histogram of :mod:`ops.metrics`,
in prometheus-client's own file format), then times
:func:`ops.exposition.render` (what ``GET /metrics`` serves: the tidy-up
of ended processes' files, the merge and the database gauges): its first
scrape, which compacts, and the ones after it, alternately with the
same-work baseline, ``generate_latest`` of a registry holding only
prometheus-client's ``MultiProcessCollector`` on the same directory, and
with that baseline on a copy of the directory as written (what a scrape
cost before the compaction). A
benchmark, not a test: it prints figures and asserts nothing.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from unittest import mock

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.utils import floatToGoString

from ops import metrics
from ops.exposition import render

from .figures import LatencySummary, summarize

#: Label values other than models and tools: a few per label, as in use.
_FEW = {
    "status": ("completed", "failed", "cancelled"),
    "kind": ("input", "output", "reasoning"),
    "error_type": ("", "model_error"),
    "error": ("OperationalError",),
}
#: First pid written: above any kernel's pid_max, so no process of this
#: machine has it (the scrape treats them as processes that ended).
_FIRST_PID = 1 << 23


@dataclass(frozen=True)
class MetricsBench:
    series: int
    samples: int
    ended: int
    live: int
    #: The first scrape, which compacts the ended processes' files.
    first_ms: float
    #: Scrapes after it.
    product: LatencySummary
    #: prometheus-client's own exposition of the directory as the product
    #: leaves it (compacted): the same work.
    baseline: LatencySummary
    #: prometheus-client's own exposition of the directory as written
    #: (every ended process's files): what a scrape cost without compaction.
    uncompacted: LatencySummary

    @property
    def ratio_median(self) -> float:
        return self.product.median_ms / self.baseline.median_ms


def write_process_files(path: str, *, models: int, tools: int, pids: list[int]) -> tuple[int, int]:
    """Write one file set per pid into ``path``; returns ``(series,
    samples)`` of the counters and histograms of one set."""
    values = {"model": [f"model-{i}" for i in range(models)], "tool": [f"tool_{i}" for i in range(tools)]}
    families = [m for m in vars(metrics).values() if isinstance(m, Counter | Histogram)]
    series = samples = 0
    for index, pid in enumerate(pids):
        files = {kind: MmapedDict(os.path.join(path, f"{kind}_{pid}.db")) for kind in ("counter", "histogram")}
        for family in families:
            name, labelnames, help_text = family._name, family._labelnames, family._documentation
            choices = [values.get(label) or _FEW.get(label, ("x",)) for label in labelnames]
            for labelvalues in itertools.product(*choices):
                if isinstance(family, Counter):
                    keys = [mmap_key(name, f"{name}_total", labelnames, labelvalues, help_text)]
                    target = files["counter"]
                else:
                    keys = [mmap_key(name, f"{name}_sum", labelnames, labelvalues, help_text)]
                    keys += [
                        mmap_key(
                            name,
                            f"{name}_bucket",
                            (*labelnames, "le"),
                            (*labelvalues, floatToGoString(bound)),
                            help_text,
                        )
                        for bound in family._upper_bounds
                    ]
                    target = files["histogram"]
                for key in keys:
                    target.write_value(key, 1.0, 0.0)
                if index == 0:
                    series += 1
                    samples += len(keys)
        for file in files.values():
            file.close()
    return series, samples


def bench_metrics(*, models: int, tools: int, ended: int, live: int, rounds: int) -> MetricsBench:
    """Write the files of ``ended`` processes that ended and of ``live``
    running ones (``sleep`` processes started for it), then time the
    scrapes: the product's first, then ``rounds`` of each kind alternately.
    The directory is deleted and the processes stopped at the end."""
    sleepers = [subprocess.Popen(["sleep", "3600"]) for _ in range(live)]
    try:
        with (
            tempfile.TemporaryDirectory(prefix="bench-metrics-") as path,
            tempfile.TemporaryDirectory(prefix="bench-metrics-as-written-") as as_written,
        ):
            pids = [_FIRST_PID + index for index in range(ended)] + [sleeper.pid for sleeper in sleepers]
            series, samples = write_process_files(path, models=models, tools=tools, pids=pids)
            for name in os.listdir(path):
                shutil.copy(os.path.join(path, name), as_written)

            def client_scrape(directory: str):
                def scrape() -> bytes:
                    registry = CollectorRegistry()
                    multiprocess.MultiProcessCollector(registry, path=directory)
                    return generate_latest(registry)

                return scrape

            timings: dict[str, list[float]] = {"product": [], "baseline": [], "uncompacted": []}
            with mock.patch.dict(os.environ, {"PROMETHEUS_MULTIPROC_DIR": path}):
                started = time.perf_counter()
                render()
                first = time.perf_counter() - started
                kinds = (("product", render), ("baseline", client_scrape(path)))
                kinds += (("uncompacted", client_scrape(as_written)),)
                for _ in range(rounds):
                    for kind, scrape in kinds:
                        started = time.perf_counter()
                        scrape()
                        timings[kind].append(time.perf_counter() - started)
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
    return MetricsBench(
        series=series,
        samples=samples,
        ended=ended,
        live=live,
        first_ms=first * 1000,
        **{kind: summarize(values) for kind, values in timings.items()},
    )
