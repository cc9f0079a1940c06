"""The ports the tests hand to the processes they start (the web server,
the replay server, private PostgreSQL and Redis, Phoenix)."""

from __future__ import annotations

from tests.e2e import stack


def test_free_ports_are_never_handed_out_twice_and_lie_below_the_ephemeral_range():
    # CI once drew the same port for two processes of one stack (or an
    # outgoing connection took it first): the web server failed to bind.
    low = stack._ephemeral_low()
    ports = [stack.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(10000 <= port < low for port in ports)
