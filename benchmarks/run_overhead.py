"""What the product's run path costs over the bare graph
(``python manage.py bench_run_overhead``).

One run is one turn of the ``assistant`` agent on the replay scenario
``tool_then_answer`` (two model calls and one tool call, no delay: the
replay model server answers at once, in a thread of this process). Four
variants of the same run, in this process, interleaved one by one so they
share the machine's load:

* **plain graph** — the compiled agent, no checkpointer, its v3 event
  stream consumed (``astream_events(version="v3")``);
* **checkpointer** — the same with LangGraph's ``AsyncPostgresSaver`` on
  the product's database, opened per run as LangGraph documents it
  (``AsyncPostgresSaver.from_conn_string``: a connection per run);
* **product** — the worker's whole run path on a submitted run
  (:func:`audit.execution.runner.run_execute`: lease, audit rows, live events in
  Redis, terminal transaction, and its checkpointer on the connection the
  worker loop keeps from run to run);
* **kept checkpointer** — for the record, not in the ratio: the
  checkpointer variant as the product runs it
  (:func:`audit.execution.checkpoint.open_checkpointer` on the worker loop: the
  connection kept from run to run, reconnecting), so that the audit's
  own cost (product - kept checkpointer) is printed beside the ratio.

Each variant's run time is measured from the call to its end; every run
uses a thread of its own. All four run on the worker's event loop, as the
worker runs its runs (:func:`audit.execution.worker_loop.run_in_worker_loop`: one
loop per worker thread, kept from run to run), so that the loop's set-up
is no variant's overhead. Per round the medians give the checkpointer's
overhead (checkpointer - plain) and the product's (product - checkpointer)
and their ratio (target: at most 1.0x), and the audit's alone (product -
kept checkpointer) and its ratio to the checkpointer's overhead; the
figures are the median over the rounds. Each run's CPU time is measured
too (:mod:`benchmarks.cpu`: this process's, every thread, and the local
PostgreSQL servers'), its mean per round: the audit's CPU alone (product
- kept checkpointer) against the checkpointer's (kept checkpointer -
plain graph), like for like, since wall-time differences swing with the
machine's load. The process's resident memory is sampled every ``rss_every``
product runs (R-OPS: worker memory must stay flat after warm-up).

It creates a throw-away user, threads, runs, checkpoints and Redis streams
and deletes them at the end. A benchmark, not a test: prints nothing
itself and asserts nothing.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

from audit.agents.assistant import build_agent
from audit.agents.models import model_http_client
from audit.agents.tools import AgentContext
from audit.execution.checkpoint import open_checkpointer, postgres_conninfo
from audit.execution.runner import run_execute
from audit.execution.worker_loop import close_kept_connections, run_in_worker_loop
from audit.ledger import run_submit
from conversations.models import Conversation
from core.config import get_config
from core.db import release_connection
from core.redis_client import stream_key
from yuxi_project.runtime import tune_gc

from .cpu import CpuMeter

SCENARIO_MODEL = "replay:tool_then_answer"
VARIANTS = ("plain graph", "checkpointer", "product", "kept checkpointer")


@dataclass
class RunOverheadResult:
    """Milliseconds, per round and the median over rounds."""

    runs_per_round: int
    # variant -> per-round median run time (ms)
    round_median_ms: dict[str, list[float]] = field(default_factory=dict)
    # per round: checkpointer - plain, product - checkpointer, their ratio
    round_checkpointer_overhead_ms: list[float] = field(default_factory=list)
    round_product_overhead_ms: list[float] = field(default_factory=list)
    round_ratio: list[float] = field(default_factory=list)
    # per round: product - kept checkpointer (the audit alone), its ratio
    # to the checkpointer's overhead
    round_audit_ms: list[float] = field(default_factory=list)
    round_audit_ratio: list[float] = field(default_factory=list)
    # (product runs so far, resident set size in MiB)
    rss_mib: list[tuple[int, float]] = field(default_factory=list)
    # variant -> per-round mean CPU per run (ms): this process (every
    # thread), and the local PostgreSQL servers (empty where /proc cannot
    # tell); see benchmarks.cpu. Means, not medians: the server's time
    # comes in 10 ms clock ticks.
    round_cpu_ms: dict[str, list[float]] = field(default_factory=dict)
    round_server_cpu_ms: dict[str, list[float]] = field(default_factory=dict)

    def cpu_overhead_ms(self, variant: str, over: str, *, server: bool = False) -> float:
        """Median over the rounds of ``variant``'s CPU per run minus
        ``over``'s (ms): this process's, plus the servers' with ``server``."""

        def per_round(v: str) -> list[float]:
            process = self.round_cpu_ms[v]
            if not server:
                return process
            return [p + s for p, s in zip(process, self.round_server_cpu_ms[v], strict=True)]

        return statistics.median(a - b for a, b in zip(per_round(variant), per_round(over), strict=True))

    @property
    def has_server_cpu(self) -> bool:
        return all(self.round_server_cpu_ms.get(v) for v in VARIANTS)

    def median(self, values: list[float]) -> float:
        return statistics.median(values)


def _rss_mib() -> float:
    """Resident set size of this process, MiB (Linux ``/proc``)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return float("nan")
    import resource

    return pages * resource.getpagesize() / 2**20


class _ReplayServer:
    """The replay model server in a thread of this process."""

    def __enter__(self) -> str:
        from audit.replay.scenarios import load_scenarios
        from audit.replay.server import make_server

        self.server = make_server(load_scenarios(), "127.0.0.1", 0)
        self.thread = threading.Thread(target=self.server.run, name="replay-model-server", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while self.server.base_url is None:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the replay model server did not start")
            time.sleep(0.01)
        return self.server.base_url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


async def _graph_run(
    thread_id: uuid.UUID, *, conninfo: str | None, workspace: Path, kept_connection: bool = False
) -> None:
    """One turn through the compiled agent, its v3 stream consumed; with a
    PostgreSQL checkpointer when ``conninfo`` is given: LangGraph's
    ``AsyncPostgresSaver.from_conn_string`` (a connection per run), or with
    ``kept_connection`` the product's (:func:`open_checkpointer`)."""
    context = AgentContext(thread_id=str(thread_id), run_id=str(uuid.uuid4()), workspace=str(workspace))
    config = {"configurable": {"thread_id": str(thread_id)}, "recursion_limit": 40}
    message = {"messages": [HumanMessage(content="weather in Paris?", id=f"human-{uuid.uuid4()}")]}
    async with model_http_client() as http_client:
        if conninfo is None:
            saver = contextlib.nullcontext()
        elif kept_connection:
            saver = open_checkpointer(conninfo)
        else:
            saver = AsyncPostgresSaver.from_conn_string(conninfo)
        async with saver as checkpointer:
            graph = build_agent(
                "assistant", model=SCENARIO_MODEL, checkpointer=checkpointer, http_async_client=http_client
            )
            stream = await graph.astream_events(message, config, version="v3", context=context)
            async for _ in stream:
                pass


#: The tables one run writes: the product's and LangGraph's checkpointer's.
RUN_TABLES = (
    "audit_agentrun",
    "conversations_conversation",
    "conversations_message",
    "checkpoints",
    "checkpoint_writes",
    "checkpoint_blobs",
)


def settle_unless_autovacuum(log) -> bool:
    """On a PostgreSQL server whose autovacuum is off (some development
    and CI machines: this project's), the tables a run writes keep every
    dead row version and their statistics never change: the terminal
    transaction's plans then read a bloated partial index (13.1 ms instead
    of 7.9 ms for one run's end in isolation, here). Then say so with
    ``log`` and ``VACUUM (ANALYZE)`` :data:`RUN_TABLES` and the rollups
    first, the state autovacuum keeps a deployment in. Returns whether it
    did."""
    from .read_paths import rollup_tables, settle

    with connection.cursor() as cursor:
        cursor.execute("SHOW autovacuum")
        if cursor.fetchone()[0] == "on":
            return False
    log("autovacuum is off on this server: the tables a run writes are vacuumed and analyzed first")
    settle(tables=[*RUN_TABLES, *rollup_tables()], log=log)
    return True


def bench_run_overhead(
    *, runs: int = 40, rounds: int = 5, warmup: int = 5, rss_every: int = 200, memory_runs: int = 0
) -> RunOverheadResult:
    """Run the benchmark: ``rounds`` rounds of ``runs`` runs per variant,
    the four variants interleaved run by run (their order rotating), after
    ``warmup`` unmeasured runs of each; then ``memory_runs`` more product
    runs alone (untimed), so the memory samples reach thousands of runs in
    reasonable time. Returns the figures."""
    config = get_config()
    conninfo = postgres_conninfo()
    if conninfo is None:
        raise RuntimeError("bench_run_overhead needs PostgreSQL (DATABASE_URL)")
    first_day = timezone.now().astimezone(dt.UTC).date()
    user = get_user_model().objects.create_user(username=f"bench-run-{uuid.uuid4().hex[:12]}")
    workspace = Path(config.WORKSPACE_ROOT) / f"bench-{uuid.uuid4().hex[:12]}"
    workspace.mkdir(parents=True, exist_ok=True)
    thread_ids: list[uuid.UUID] = []
    run_ids: list[uuid.UUID] = []
    result = RunOverheadResult(
        runs_per_round=runs,
        round_median_ms={v: [] for v in VARIANTS},
        round_cpu_ms={v: [] for v in VARIANTS},
        round_server_cpu_ms={v: [] for v in VARIANTS},
    )
    product_runs = 0

    def new_thread() -> uuid.UUID:
        thread = Conversation.objects.create(user=user, agent_id="assistant", model=SCENARIO_MODEL)
        thread_ids.append(thread.id)
        return thread.id

    def one(variant: str) -> tuple[float, CpuMeter]:
        """One run of ``variant``: its wall time (s) and its CPU."""
        nonlocal product_runs
        if variant == "product":
            thread_id = new_thread()
            run, _ = run_submit(user=user, thread_id=thread_id, request_id=uuid.uuid4().hex, text="weather in Paris?")
            release_connection()
            run_ids.append(run.id)
            with CpuMeter() as cpu:
                began = time.perf_counter()
                status = run_execute(run_id=run.id, owner="bench")
                elapsed = time.perf_counter() - began
            if status != "completed":
                raise RuntimeError(f"a product run ended {status}")
            product_runs += 1
            if product_runs % rss_every == 0:
                result.rss_mib.append((product_runs, _rss_mib()))
            return elapsed, cpu
        saved = variant != "plain graph"
        thread_id = new_thread() if saved else uuid.uuid4()
        release_connection()
        with CpuMeter() as cpu:
            began = time.perf_counter()
            run_in_worker_loop(
                _graph_run(
                    thread_id,
                    conninfo=conninfo if saved else None,
                    workspace=workspace,
                    kept_connection=variant == "kept checkpointer",
                )
            )
            elapsed = time.perf_counter() - began
        return elapsed, cpu

    previous_url = config.REPLAY_MODEL_URL
    quiet = [logging.getLogger(name) for name in ("audit.replay.server", "uvicorn.error", "audit.execution.runner")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.WARNING)
    try:
        with _ReplayServer() as url:
            config.REPLAY_MODEL_URL = url
            for _ in range(warmup):
                for variant in VARIANTS:
                    one(variant)
            # As the worker does before it starts its pool (yuxi_project.celery):
            # the code the runs use is loaded now (the warm-up at least
            # imported it), then out of the collector's way.
            tune_gc()
            result.rss_mib.append((product_runs, _rss_mib()))
            for r in range(rounds):
                samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
                cpu: dict[str, list[CpuMeter]] = {v: [] for v in VARIANTS}
                for i in range(runs):
                    shift = (r * runs + i) % len(VARIANTS)
                    for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                        elapsed, meter = one(variant)
                        samples[variant].append(elapsed * 1000)
                        cpu[variant].append(meter)
                medians = {v: statistics.median(samples[v]) for v in VARIANTS}
                for v in VARIANTS:
                    result.round_median_ms[v].append(medians[v])
                    result.round_cpu_ms[v].append(statistics.fmean(m.process_ms for m in cpu[v]))
                    if all(m.server_ms is not None for m in cpu[v]):
                        result.round_server_cpu_ms[v].append(statistics.fmean(m.server_ms for m in cpu[v]))
                saver = medians["checkpointer"] - medians["plain graph"]
                product = medians["product"] - medians["checkpointer"]
                result.round_checkpointer_overhead_ms.append(saver)
                result.round_product_overhead_ms.append(product)
                result.round_ratio.append(product / saver if saver > 0 else float("inf"))
                audit = medians["product"] - medians["kept checkpointer"]
                result.round_audit_ms.append(audit)
                result.round_audit_ratio.append(audit / saver if saver > 0 else float("inf"))
            for _ in range(memory_runs):
                one("product")
            if not result.rss_mib or result.rss_mib[-1][0] != product_runs:
                result.rss_mib.append((product_runs, _rss_mib()))
    finally:
        close_kept_connections()
        config.REPLAY_MODEL_URL = previous_url
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
        _clean_up(user, thread_ids, run_ids, workspace, first_day=first_day)
    return result


def _clean_up(user, thread_ids: list[uuid.UUID], run_ids: list[uuid.UUID], workspace: Path, *, first_day) -> None:
    import shutil

    from .databases import throwaway_user_delete

    with connection.cursor() as cursor:
        for table in ("checkpoint_writes", "checkpoint_blobs", "checkpoints"):
            cursor.execute(f"DELETE FROM {table} WHERE thread_id = ANY(%s)", [[str(t) for t in thread_ids]])
    throwaway_user_delete(user, bench="bench_run_overhead", since=first_day)
    release_connection()
    redis_url = get_config().REDIS_URL
    if redis_url and run_ids:
        import redis

        client = redis.Redis.from_url(redis_url)
        for start in range(0, len(run_ids), 500):
            client.delete(*(stream_key(run_id) for run_id in run_ids[start : start + 500]))
        client.close()
    shutil.rmtree(workspace, ignore_errors=True)
    for thread_id in thread_ids:
        shutil.rmtree(Path(get_config().WORKSPACE_ROOT) / str(thread_id), ignore_errors=True)
