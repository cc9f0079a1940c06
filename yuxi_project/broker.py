"""The Redis broker transport of the Celery workers (R-RUN-9): kombu's, except
that losing Redis never ends a worker.

Celery wires it with ``broker_transport`` (``CELERY_BROKER_TRANSPORT`` in
the settings) whenever ``REDIS_URL`` is set; the embedded mode keeps
``memory://``.

Why it exists. With ``task_acks_late`` a worker holds the messages of the
runs it executes unacknowledged. When Redis dies, Celery's consumer
collects the broken connection (``kombu.Connection.collect``), which
detaches the transport from its connection (``transport.client = None``),
and then closes it. Closing the channel restores the unacknowledged
messages (``QoS.restore_unacked_once``), and kombu's Redis channel builds a
new client from ``transport.client``: ``AttributeError: 'NoneType' object
has no attribute 'hostname'``. That is not a connection error, so Celery
logs "Unrecoverable error" and the worker exits once its running tasks end
(kombu 5.7). The same restore against a Redis that is down raises a
connection error out of ``Channel.close``.

The product does not need that restore: PostgreSQL, not the broker, says
what must run. The dispatcher (:mod:`audit.execution.dispatch`) hands a pending run
over again when its message is lost, and a run still executing in this
worker keeps its lease in PostgreSQL. So :class:`QoS` restores as kombu does
while the connection works (a graceful shutdown), and when it does not,
logs a warning and forgets the messages instead of raising out of
``close``. A late ack or reject of such a message (its run ended after the
connection was lost) would rebuild a client the same way and end the
worker too; it is dropped: the message died with the old connection or,
if Redis kept it, comes back after the visibility timeout and finds its
run ended, which starts nothing (R-RUN-3).
"""

from __future__ import annotations

import logging

from celery.worker.consumer import Consumer as CeleryConsumer
from kombu.transport import redis

log = logging.getLogger(__name__)

LOST_UNACKED = (
    "Broker connection lost: not restoring %d unacknowledged message(s) (%s); "
    "PostgreSQL keeps the runs and the dispatcher hands any pending one over again (R-RUN-9)"
)


class QoS(redis.QoS):
    """kombu's Redis ack emulation, tolerant of a connection that is gone."""

    def _transport_detached(self) -> bool:
        """Whether the channel can no longer build a Redis client: closed
        (``channel.connection`` is None) or its transport collected after a
        connection loss (``transport.client`` is None)."""
        transport = self.channel.connection
        return transport is None or transport.client is None

    def restore_unacked(self, client=None) -> None:
        """Push the unacknowledged messages back to their queues, as kombu
        does, when the broker can be reached; otherwise log a warning and
        forget them (the dispatcher re-enqueues their runs, R-RUN-9).
        Raises nothing: it runs inside ``Channel.close``."""
        count = len(self._delivered)
        if client is None and self._transport_detached():
            log.warning(LOST_UNACKED, count, "the connection was collected")
            self._delivered.clear()
            return
        try:
            super().restore_unacked(client)
        except Exception as exc:  # noqa: BLE001 - any failure here would end the worker; the runs are safe in PostgreSQL
            log.warning(LOST_UNACKED, count, repr(exc))
            self._delivered.clear()

    def ack(self, delivery_tag) -> None:
        """Acknowledge as kombu does; on a channel whose connection was
        lost, only forget the message here (see the module docstring)."""
        if self._transport_detached():
            self._forget(delivery_tag, "acknowledged")
            return
        super().ack(delivery_tag)

    def reject(self, delivery_tag, requeue=False) -> None:
        """Reject as kombu does; on a channel whose connection was lost (a
        pool process died after it), only forget the message here: the
        dispatcher or the lease sweeper takes care of its run (R-RUN-9,
        R-RUN-7)."""
        if self._transport_detached():
            self._forget(delivery_tag, "rejected")
            return
        super().reject(delivery_tag, requeue=requeue)

    def _forget(self, delivery_tag, what: str) -> None:
        log.info("Broker connection lost: message %s cannot be %s on its old connection", delivery_tag, what)
        # The virtual QoS's bookkeeping only: it needs no Redis client.
        super(redis.QoS, self).ack(delivery_tag)


class Channel(redis.Channel):
    """kombu's Redis channel with :class:`QoS`."""

    QoS = QoS


class Transport(redis.Transport):
    """kombu's Redis transport with :class:`Channel`; the value of
    ``CELERY_BROKER_TRANSPORT`` is ``"yuxi_project.broker:Transport"``."""

    Channel = Channel


class Consumer(CeleryConsumer):
    """Celery's worker consumer with its Mingle and Gossip steps off, as
    ``--without-mingle --without-gossip`` would set them; the value of
    ``CELERY_WORKER_CONSUMER`` is ``"yuxi_project.broker:Consumer"``
    (R-RUN-9).

    Mingle asks the other workers for their revoked tasks and logical clock
    each time the consumer (re)connects; Gossip follows every other
    worker's events. The product uses neither: a run is cancelled in
    PostgreSQL (R-RUN-6), never by a Celery revoke, and no step elects or
    watches workers. Both are what reports of Redis workers that reconnect
    and then consume nothing implicate (celery/celery#8030, #8082, #8384,
    #10205: a broker lost several times within seconds, the consumer's
    reconnect caught in Mingle's exchange); running without them is those
    reports' remedy. The steps stay in the consumer's graph (its task
    consumer requires Mingle's place in the boot order) but do not start.
    Heartbeats (monitoring) and remote control (``celery inspect``, the
    health check's ping) stay on."""

    def __init__(self, *args, worker_options=None, **kwargs):
        options = {**(worker_options or {}), **WITHOUT_STEPS}
        super().__init__(*args, worker_options=options, **kwargs)


#: The options that switch off the consumer steps :class:`Consumer` does
#: not start.
WITHOUT_STEPS = {"without_mingle": True, "without_gossip": True}
