"""Run as a process by test_checkpoint_reconnect: a run's checkpointer is
closed (``aclose``) or interrupted while a write of its State waits on a
lock of the checkpoint tables, a few times over; ``cut``: interrupted while
the database refuses connections, so the session cannot be ended and the
connection is cut under the waiting fetch. Exits 0 when the process
survives; a close that frees the connection under the waiting fetch makes
it die of a segmentation fault (certain under ``MALLOC_PERTURB_``).

Arguments: ``aclose|interrupt|cut <conninfo> <times>``."""

from __future__ import annotations

import asyncio
import sys
import uuid

import django


async def _once(close: str, conninfo: str) -> None:
    import psycopg
    from langgraph.checkpoint.base import empty_checkpoint

    from audit.execution.checkpoint import CHECKPOINTER_APPLICATION_NAME, open_checkpointer

    config = {"configurable": {"thread_id": str(uuid.uuid4()), "checkpoint_ns": ""}}
    async with (
        await psycopg.AsyncConnection.connect(conninfo) as holder,
        await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as admin,
    ):
        async with open_checkpointer(conninfo) as saver:
            saved = await saver.aput(config, empty_checkpoint(), {"step": 0}, {})
            await holder.execute("LOCK TABLE checkpoints, checkpoint_writes, checkpoint_blobs IN ACCESS EXCLUSIVE MODE")
            write = asyncio.create_task(saver.aput(saved, empty_checkpoint(), {"step": 1}, {}))
            waiting = "SELECT 1 FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'"
            while not await (await admin.execute(waiting, [CHECKPOINTER_APPLICATION_NAME])).fetchone():
                await asyncio.sleep(0.005)
            if close == "interrupt":
                await saver.interrupt()
            elif close == "cut":
                await _allow_connections(conninfo, False)
                try:
                    await saver.interrupt()
                finally:
                    await _allow_connections(conninfo, True)
        # open_checkpointer's exit closed the saver (aclose).
        try:
            await write
        except psycopg.OperationalError:
            pass  # the State write of an ended run fails: expected
        await holder.rollback()


async def _allow_connections(conninfo: str, allowed: bool) -> None:
    import psycopg
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    name = conninfo_to_dict(conninfo)["dbname"]
    async with await psycopg.AsyncConnection.connect(make_conninfo(conninfo, dbname="postgres"), autocommit=True) as a:
        await a.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(allowed).lower()}')


async def _main(close: str, conninfo: str, times: int) -> None:
    for _ in range(times):
        await _once(close, conninfo)


if __name__ == "__main__":
    django.setup()
    asyncio.run(_main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
