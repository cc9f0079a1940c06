"""The multiprocess metric files of processes that ended (R-OPS-1, issue 38).

prometheus-client keeps one file set per process in
``PROMETHEUS_MULTIPROC_DIR`` and merges them all at every scrape. A file
set stays after its process ends, because what a counter counted did
happen; with prefork children replaced and web processes restarted the
directory grows without bound, and so does every scrape. Two tidy-ups run
before each scrape (:func:`ops.exposition.render`):

- :func:`forget_dead_processes` drops the live gauges of ended processes
  (prometheus-client's ``mark_process_dead``);
- :func:`compact_dead_processes` sums the counter and histogram files of
  ended processes into one archive file per type (``counter_archive.db``,
  ``histogram_archive.db``), which the merge reads like any process's file:
  the exposition is the same, and a directory of ended processes costs one
  file set.

Counter and histogram values in these files are raw (not cumulative, no
pid label): summing them by key is exactly what the merge does. A
compaction and a scrape exclude each other with ``flock`` on
``metrics.lock`` (:func:`scrape_lock`), so no scrape sees the archive and
the files it absorbed at once, which would count them twice. A compaction
is crash safe: the new archive files are written beside the old ones, a
journal naming what to rename and delete is committed by one rename, and
a compaction cut after that is finished by the next one.

The pids are those of this host's process namespace (one directory per
host or container, as ``PROMETHEUS_MULTIPROC_DIR`` is documented).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
from collections import defaultdict
from collections.abc import Iterator

from prometheus_client import multiprocess
from prometheus_client.mmap_dict import MmapedDict

#: File types that are summed across processes (gauges have modes of
#: their own and are left alone; the product's only gauge is live).
SUMMED_TYPES = ("counter", "histogram")
ARCHIVE = "archive"
LOCK_FILE = "metrics.lock"
JOURNAL_FILE = "compaction.journal"
_PENDING = ".pending"


def forget_dead_processes(path: str) -> list[int]:
    """Drop the live gauges (``yuxi_sse_streams_open``) of processes of this
    host that are gone, however they ended (killed, crashed, a prefork child
    replaced): ``prometheus_client`` keeps a dead process's file, so its
    open streams would be counted for ever. Counters and histograms of dead
    processes stay (:func:`compact_dead_processes`).

    ``path`` is the multiprocess directory. Returns the pids forgotten.
    Implements R-OPS-1.
    """
    dead = set()
    for name in glob.glob(os.path.join(path, "gauge_live*_*.db")):
        pid = os.path.basename(name)[: -len(".db")].rsplit("_", 1)[1]
        if pid.isdigit() and not _alive(int(pid)):
            dead.add(int(pid))
    for pid in dead:
        multiprocess.mark_process_dead(pid, path)
    return sorted(dead)


def compact_dead_processes(path: str) -> list[int]:
    """Sum the counter and histogram files of the ended processes of this
    host in ``path`` into the archive files, and delete them. Finishes a
    compaction that was cut off first. Returns the pids compacted. Takes
    :func:`scrape_lock` exclusively; raises ``OSError`` when the directory
    cannot be written (the scrape then reads the files as they are)."""
    with scrape_lock(path, exclusive=True):
        _finish_journal(path)
        dead = sorted(
            {pid for typ in SUMMED_TYPES for pid in _pids(path, typ) if not _alive(pid)},
        )
        if not dead:
            return []
        renames, deletions = [], []
        for typ in SUMMED_TYPES:
            sources = [os.path.join(path, f"{typ}_{pid}.db") for pid in dead]
            sources = [name for name in sources if os.path.exists(name)]
            if not sources:
                continue
            archive = os.path.join(path, f"{typ}_{ARCHIVE}.db")
            totals: dict[str, float] = defaultdict(float)
            for name in ([archive] if os.path.exists(archive) else []) + sources:
                for key, value, _timestamp, _position in MmapedDict.read_all_values_from_file(name):
                    totals[key] += value
            pending = archive + _PENDING
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pending)
            merged = MmapedDict(pending)
            try:
                for key, value in totals.items():
                    merged.write_value(key, value, 0.0)
            finally:
                merged.close()
            _fsync(pending)
            renames.append([pending, archive])
            deletions += sources
        _commit_journal(path, {"rename": renames, "delete": deletions})
        _finish_journal(path)
        return dead


@contextlib.contextmanager
def scrape_lock(path: str, *, exclusive: bool = False) -> Iterator[None]:
    """Hold ``flock`` on ``path/metrics.lock``: shared for a scrape,
    exclusive for a compaction."""
    descriptor = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(descriptor)  # closing releases the lock


def _pids(path: str, typ: str) -> set[int]:
    found = set()
    for name in glob.glob(os.path.join(path, f"{typ}_*.db")):
        pid = os.path.basename(name)[len(typ) + 1 : -len(".db")]
        if pid.isdigit():
            found.add(int(pid))
    return found


def _commit_journal(path: str, plan: dict) -> None:
    journal = os.path.join(path, JOURNAL_FILE)
    with open(journal + _PENDING, "w", encoding="utf-8") as file:
        json.dump(plan, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(journal + _PENDING, journal)  # the commit point


def _finish_journal(path: str) -> None:
    """Carry out a committed journal (again: each step may already be
    done); without one, remove what a cut compaction left pending."""
    journal = os.path.join(path, JOURNAL_FILE)
    try:
        with open(journal, encoding="utf-8") as file:
            plan = json.load(file)
    except FileNotFoundError:
        for name in glob.glob(os.path.join(path, f"*{_PENDING}")):
            os.unlink(name)
        return
    for pending, final in plan["rename"]:
        if os.path.exists(pending):
            os.replace(pending, final)
    for name in plan["delete"]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
    os.unlink(journal)


def _fsync(name: str) -> None:
    descriptor = os.open(name, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    except OverflowError:  # no process can have it
        return False
    try:  # a zombie (ended, not yet reaped by its parent) serves nothing
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
