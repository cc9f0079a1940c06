"""The worker's event loop, kept from run to run (issue 11: share
connections): what asyncio.run guaranteed for one run still holds, and the
runs of a thread share its Redis connections."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest
import redis
from django.conf import settings

from audit.execution.runner import run_execute
from audit.execution.worker_loop import run_in_worker_loop, worker_client_name, worker_redis
from audit.ledger.cancellation import CancelSignalListener, cancel_channel, cancel_key
from tests.conftest import make_run

pytestmark = pytest.mark.django_db(transaction=True)

_flag: contextvars.ContextVar[str] = contextvars.ContextVar("test_worker_loop_flag", default="unset")


def _worker_connections(client: redis.Redis) -> set[str]:
    """Ids of the Redis connections of this thread's worker loop."""
    return {entry["id"] for entry in client.client_list() if entry.get("name") == worker_client_name()}


def test_the_runs_of_a_thread_share_its_redis_connections(thread, replay_models):
    """Each run used to make a client and a subscription of its own: two
    new Redis connections (and their handshakes) a run. Now the second and
    later runs of a thread reuse the first run's two."""
    client = redis.Redis.from_url(settings.CONFIG.REDIS_URL)
    assert run_execute(run_id=make_run(thread, text="first").id, owner="worker-a") == "completed"
    # The client's pool (more than one connection when the events' flush
    # and the cancel key check overlap) and the subscription; earlier runs
    # of this thread (other tests) may have made them already.
    after_first = _worker_connections(client)
    assert len(after_first) >= 2
    for text in ("second", "third"):
        assert run_execute(run_id=make_run(thread, text=text).id, owner="worker-a") == "completed"
    after_third = _worker_connections(client)
    assert after_first <= after_third, "a connection of the first run was replaced"
    assert len(after_third) <= len(after_first) + 1


def test_a_task_a_run_leaves_behind_is_cancelled_before_the_next_run():
    started = []

    async def leaves_a_task():
        async def forever():
            started.append(True)
            await asyncio.sleep(3600)

        return asyncio.create_task(forever())

    task = run_in_worker_loop(leaves_a_task())
    assert started == [True]
    assert task.cancelled()


def test_a_run_sees_the_callers_context_and_leaves_nothing_in_the_next_ones():
    async def set_flag():
        before = _flag.get()
        _flag.set("set by a run")
        return before

    token = _flag.set("the caller's")
    try:
        assert run_in_worker_loop(set_flag()) == "the caller's"
    finally:
        _flag.reset(token)
    assert run_in_worker_loop(set_flag()) == "unset"


def test_a_run_may_raise_and_the_loop_serves_the_next_one():
    async def fails():
        raise ValueError("the run's own error")

    async def answers():
        return 42

    with pytest.raises(ValueError, match="the run's own error"):
        run_in_worker_loop(fails())
    assert run_in_worker_loop(answers()) == 42


def test_each_thread_has_a_loop_of_its_own():
    async def loop_id():
        return id(asyncio.get_running_loop())

    here = run_in_worker_loop(loop_id())
    there: list[int] = []
    other = threading.Thread(target=lambda: there.append(run_in_worker_loop(loop_id())))
    other.start()
    other.join()
    assert run_in_worker_loop(loop_id()) == here
    assert there and there[0] != here


def test_an_earlier_runs_signal_on_the_shared_subscription_is_no_signal_R_RUN_6(thread):
    """One subscription serves the thread's runs one after the other: a
    signal for the run before (sent as it ended) must not cancel the next."""
    earlier, later = make_run(thread, text="earlier"), make_run(thread, text="later")
    shared = worker_redis(settings.CONFIG.REDIS_URL)
    publisher = redis.Redis.from_url(settings.CONFIG.REDIS_URL)
    publisher.delete(cancel_key(earlier.id), cancel_key(later.id))

    async def listen():
        first = CancelSignalListener(earlier.id, shared=shared)
        assert await first.wait(0.05) is False
        publisher.publish(cancel_channel(earlier.id), "cancel")  # read by nobody yet
        await first.close()
        publisher.publish(cancel_channel(earlier.id), "cancel")  # after the unsubscribe
        second = CancelSignalListener(later.id, shared=shared)
        try:
            stale = await second.wait(0.5)
            publisher.publish(cancel_channel(later.id), "cancel")
            own = await second.wait(5)
            return stale, own
        finally:
            await second.close()

    assert run_in_worker_loop(listen()) == (False, True)


def test_a_broken_shared_subscription_is_made_anew_for_the_next_run_R_RUN_6(thread):
    """Redis dropped the subscription's connection (a restart, a kill):
    the listener that met the error lets the run poll the database, and
    the next run's listener subscribes on a new connection."""
    run = make_run(thread)
    shared = worker_redis(settings.CONFIG.REDIS_URL)
    admin = redis.Redis.from_url(settings.CONFIG.REDIS_URL)
    admin.delete(cancel_key(run.id))

    async def listen():
        first = CancelSignalListener(run.id, shared=shared)
        assert await first.wait(0.05) is False
        # Only this process's subscription: a shared Redis serves others.
        ours = [entry["id"] for entry in admin.client_list(_type="pubsub") if entry.get("name") == worker_client_name()]
        assert len(ours) == 1
        admin.client_kill_filter(_id=ours[0])
        assert await first.wait(0.3) is False  # the error: a sleep, no signal
        await first.close()
        second = CancelSignalListener(run.id, shared=shared)
        try:
            assert await second.wait(0.05) is False
            admin.publish(cancel_channel(run.id), "cancel")
            return await second.wait(5)
        finally:
            await second.close()

    assert run_in_worker_loop(listen()) is True
