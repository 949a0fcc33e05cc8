"""The AMQP intake: one consuming channel per queue feeding the engine, and the confirming handoff channel.

Per physical queue a channel of its own (so prefetch and admission are per queue and
a slow queue never starves another), consumed straight through aiormq: each
delivery becomes one light :class:`~lily_mongo._amqp.AmqpMessage` handed to
:meth:`Engine.receive`. A robust channel that comes back (a reconnect, a channel error)
is consumed again; a new connection transport is a new transport generation, whose
predecessors' deliveries have no settlement authority (docs/settlement.md, generations).
A consumer the broker cancels (a consumer timeout, a deleted queue) is consumed again on
a new channel, the queue declared again first when it is gone and lily declares it; the
old channel is closed, so its deliveries lose their settlement authority the same way
(docs/deployment.md, "Consumer timeout").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import aio_pika
import aio_pika.abc
import aiormq.abc
import aiormq.exceptions

from .._amqp import AckCoalescer, AmqpMessage, republish, unbounded_frame_queue
from .._backoff import backoff
from .._errors import PublishError
from .._plan.options import consumer_timeout_warning
from .._topology import declare_topology
from .engine import Engine
from .message import InboundMessage
from .queues import QueueState

__all__ = ["AmqpIntake", "QueueConsumer", "cancel_cause"]

log = logging.getLogger("lily_mongo")

# Consuming again after a broker's cancel: the first try after 0.05-0.1 s, each later one
# after twice as long, at most 5 s (with equal jitter, docs/deployment.md).
_RESUME_BASE = 0.1
_RESUME_CAP = 5.0
# Settlement's share of a delivery's unacknowledged time, besides the handoff's confirm: the
# longest pause before a requeue (docs/settlement.md, section 4).
_REQUEUE_PAUSE_MAX = 2.0


def cancel_cause(*, exists: bool | None, busy: bool, declares: bool) -> str:
    """The likely cause of a broker's ``basic.cancel``, which gives none: ``exists`` says whether the
    queue exists now (None: unknown), ``busy`` whether deliveries of the queue were unsettled then,
    ``declares`` whether the consumer declares the queue."""
    if exists is False:
        return "the queue was deleted" + ("; declaring it again" if declares else "")
    if busy:
        return (
            "likely its consumer timeout: a delivery stayed unacknowledged longer than the broker allows "
            "(docs/deployment.md)"
        )
    return "no reason given: a queue deleted and declared again, or a replica moved"


class QueueConsumer:
    """One queue's consuming side: its channel, the queue, its consumer tag, the channel's ACK coalescer."""

    __slots__ = ("acks", "channel", "consumer_tag", "queue", "resuming", "state")

    def __init__(self, state: QueueState) -> None:
        self.state = state
        self.channel: aio_pika.abc.AbstractChannel | None = None
        self.queue: aio_pika.abc.AbstractQueue | None = None
        self.consumer_tag: str | None = None  # None while the queue has no consumer
        self.acks: AckCoalescer | None = None  # the current channel's ACK coalescer (ack_delay > 0)
        self.resuming: asyncio.Task[None] | None = None  # consuming again after the broker's cancel


class AmqpIntake:
    """Feeds an :class:`Engine` from one AMQP connection; publishes its handoff copies."""

    def __init__(self, connection: aio_pika.abc.AbstractConnection, *, confirm_timeout: float) -> None:
        self.connection = connection
        self.confirm_timeout = confirm_timeout
        self.handoff_channel: aio_pika.abc.AbstractChannel | None = None
        self.consumers: dict[str, QueueConsumer] = {}
        self._engine: Engine | None = None
        self._transport: object | None = None  # the connection's transport the generation counts

    async def start(self, engine: Engine) -> None:
        """Open the handoff channel and one consuming channel per queue of ``engine``; start its intake."""
        self._engine = engine
        connection = self.connection
        self._transport = getattr(connection, "transport", None)
        if isinstance(connection, aio_pika.abc.AbstractRobustConnection):
            connection.reconnect_callbacks.add(lambda *_: self._count_transport())
        for qs in engine.queues.values():
            warning = consumer_timeout_warning(qs.options, self.confirm_timeout + _REQUEUE_PAUSE_MAX)
            if warning is not None:
                log.warning("%s", warning)
        self.handoff_channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        engine.open()
        for name, qs in engine.queues.items():
            consumer = self.consumers[name] = QueueConsumer(qs)
            await self._open(consumer)

    async def handoff(self, message: InboundMessage, routing_key: str, headers: Mapping[str, Any]) -> None:
        """The AMQP handoff: a copy through the default exchange on the confirming handoff channel."""
        assert isinstance(message, AmqpMessage)
        channel = self.handoff_channel
        if channel is None or channel.is_closed:
            raise PublishError("closed", "the handoff channel is closed")
        try:
            underlay = await channel.get_underlay_channel()
        except Exception as exc:
            raise PublishError("closed", f"the handoff channel is unavailable ({type(exc).__name__})") from exc
        await republish(underlay, message, routing_key=routing_key, headers=headers, timeout=self.confirm_timeout)

    async def _open(self, consumer: QueueConsumer) -> None:
        """Consume the queue on a new channel of its own (its QoS; the queue declared passively)."""
        options = consumer.state.options
        channel = await self.connection.channel(publisher_confirms=False)
        consumer.channel = channel
        await channel.set_qos(prefetch_count=options.effective_prefetch)
        consumer.queue = await channel.declare_queue(options.name, passive=True)
        await self._consume(consumer)
        if isinstance(channel, aio_pika.abc.AbstractRobustChannel):
            channel.reopen_callbacks.add(functools.partial(self._on_channel_reopened, consumer))

    async def _consume(self, consumer: QueueConsumer) -> None:
        """Consume the queue on its channel's current transport, straight through aiormq."""
        assert consumer.channel is not None
        options = consumer.state.options
        underlay = await consumer.channel.get_underlay_channel()
        unbounded_frame_queue(underlay)
        # One coalescer per channel object: a reopened channel gets a fresh one, so no ACK
        # marked on the old channel is ever written on the new (docs/settlement.md, generations).
        acks = None
        if options.ack_delay > 0:
            assert self._engine is not None
            spawn = functools.partial(self._engine.tasks.spawn, name="lily-acks")
            acks = AckCoalescer(underlay, options.ack_delay, spawn)
        consumer.acks = acks
        consuming = await underlay.basic_consume(options.name, self._callback(consumer.state, acks), no_ack=False)
        consumer.consumer_tag = consuming.consumer_tag
        underlay.on_consumer_cancel_callbacks.add(functools.partial(self._on_broker_cancel, consumer))

    def _on_broker_cancel(self, consumer: QueueConsumer, frame: Any) -> None:
        """The broker ended the consumer (a consumer timeout, a deleted queue): count it, consume again.

        Runs in the channel's frame reader, so it only starts the task that consumes again."""
        if consumer.consumer_tag is None or getattr(frame, "consumer_tag", None) != consumer.consumer_tag:
            return
        consumer.consumer_tag = None  # no consumer now: not ready until one is back
        engine = self._engine
        if engine is None or not engine.accepting:
            return
        qs = consumer.state
        qs.counters.broker_cancels += 1
        busy = qs.in_flight > 0 or bool(qs.buffer)
        if consumer.resuming is None or consumer.resuming.done():
            consumer.resuming = engine.tasks.spawn(self._resume(consumer, busy), name="lily-resume")

    async def _resume(self, consumer: QueueConsumer, busy: bool) -> None:
        """Consume the queue again after the broker's cancel, with bounded, jittered backoff, while the
        consumer runs; the queue is declared again first when it is gone and lily declares it."""
        engine = self._engine
        assert engine is not None
        options = consumer.state.options
        loop = asyncio.get_running_loop()
        cancelled_at = loop.time()
        await self._retire(consumer)
        retry = 0
        while engine.accepting:
            # The broker may cancel before the queue is gone (a quorum queue's deletion): look after the pause.
            await asyncio.sleep(backoff(retry, base=_RESUME_BASE, cap=_RESUME_CAP, jitter=random.random()))
            if not engine.accepting:
                return
            exists = await self._queue_exists(options.name)
            if retry == 0:
                cause = cancel_cause(exists=exists, busy=busy, declares=not options.passive)
                log.warning(
                    "the broker cancelled the consumer of queue %s (%s); consuming it again", options.name, cause
                )
            try:
                if exists is False and not options.passive:
                    await declare_topology(self.connection, options)
                await self._open(consumer)
            except Exception as exc:
                await self._retire(consumer)
                retry += 1
                if retry == 1 or retry % 10 == 0:
                    log.warning(
                        "consuming queue %s again failed (%s, try %d); trying again",
                        options.name,
                        type(exc).__name__,
                        retry,
                    )
                continue
            waited = loop.time() - cancelled_at
            log.info("consuming queue %s again, %.1f s after the broker's cancel", options.name, waited)
            return

    async def _retire(self, consumer: QueueConsumer) -> None:
        """Close the queue's consuming channel: its deliveries lose their settlement authority (their
        ACKs not written yet are not written), as on a lost channel; the broker redelivers them."""
        channel, acks = consumer.channel, consumer.acks
        consumer.consumer_tag = None
        consumer.acks = None
        if acks is not None:
            acks.drop("the broker cancelled the consumer")
        if channel is not None and not channel.is_closed:
            with contextlib.suppress(Exception):
                await channel.close()

    async def _queue_exists(self, name: str) -> bool | None:
        """Whether the queue exists (a passive declaration on a channel of its own: a 404 closes it);
        None when the broker could not be asked."""
        try:
            channel = await self.connection.channel(publisher_confirms=False)
        except Exception:
            return None
        try:
            await channel.declare_queue(name, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return False
        except Exception:
            return None
        finally:
            if not channel.is_closed:
                with contextlib.suppress(Exception):
                    await channel.close()
        return True

    async def _on_channel_reopened(self, consumer: QueueConsumer, _channel: object) -> None:
        """A robust channel came back (reconnect or channel error; QoS and the queue restored): consume again."""
        # Count a new connection transport before consuming on it: the connection's reconnect
        # callbacks run only after every channel is restored, and a delivery of the new
        # generation must not be seen while the snapshot still shows the old one.
        self._count_transport()
        if self._engine is None or not self._engine.accepting:
            return
        try:
            await self._consume(consumer)
        except Exception as exc:
            log.warning(
                "consuming %s again after a reconnect failed: %s", consumer.state.options.name, type(exc).__name__
            )

    def _count_transport(self) -> None:
        """A new connection transport is a new generation (old deliveries have lost settlement
        authority); counted once per transport, whichever callback sees it first."""
        transport = getattr(self.connection, "transport", None)
        if transport is not None and transport is not self._transport and self._engine is not None:
            self._transport = transport
            self._engine.generation += 1
            log.info("AMQP connection re-established: transport generation %d", self._engine.generation)

    def _callback(
        self, qs: QueueState, acks: AckCoalescer | None
    ) -> Callable[[aiormq.abc.DeliveredMessage], Coroutine[Any, Any, None]]:
        engine = self._engine
        assert engine is not None

        async def on_message(delivered: aiormq.abc.DeliveredMessage) -> None:
            qs.counters.received += 1
            message = AmqpMessage(delivered, acks)
            if not engine.accepting:
                # Intake stopped: give it back at once (it was never started).
                await engine.return_unstarted(message)
                return
            engine.receive(qs, message)

        return on_message

    # -- shutdown steps (called by the lifecycle supervisor) ------------------------------

    async def stop(self) -> list[BaseException]:
        """Cancel the consumers, then stop the engine's admission (buffered deliveries go back)."""
        errors: list[BaseException] = []
        engine = self._engine
        if engine is not None:
            engine.stop_accepting()
        for consumer in self.consumers.values():
            if consumer.resuming is not None and not consumer.resuming.done():
                consumer.resuming.cancel()
            channel = consumer.channel
            if consumer.consumer_tag is not None and channel is not None and not channel.is_closed:
                try:
                    underlay = await channel.get_underlay_channel()
                    await underlay.basic_cancel(consumer.consumer_tag)
                except Exception as exc:
                    errors.append(exc)
        if engine is not None:
            await engine.return_buffered()
        return errors

    def revoke(self) -> None:
        """Settlement authority is revoked: ACKs marked but not written are not written now."""
        for consumer in self.consumers.values():
            if consumer.acks is not None:
                consumer.acks.drop("settlement authority revoked")

    async def close_channels(self) -> bool:
        """Write pending ACKs (unless revoked), then close the consuming and handoff channels;
        True once all of them are closed."""
        engine = self._engine
        if engine is None or engine.has_authority:
            for consumer in self.consumers.values():
                channel = consumer.channel
                if consumer.acks is not None and channel is not None and not channel.is_closed:
                    try:
                        await consumer.acks.flush()
                    except Exception as exc:  # the channel failed: its marks failed with it
                        log.warning(
                            "writing pending ACKs of %s failed: %s", consumer.state.options.name, type(exc).__name__
                        )
        channels = [consumer.channel for consumer in self.consumers.values() if consumer.channel is not None]
        if self.handoff_channel is not None:
            channels.append(self.handoff_channel)
        for channel in channels:
            if not channel.is_closed:
                await channel.close()
        return all(channel.is_closed for channel in channels)

    def ready(self) -> bool:
        """True while every queue has its consumer, every consuming channel and the handoff channel is open."""
        return self.waiting_for() is None

    def waiting_for(self) -> str | None:
        """What readiness waits for, in words (None when ready): the first queue without a consumer or
        an open channel, or the handoff channel."""
        for name, consumer in self.consumers.items():
            if consumer.channel is None or consumer.channel.is_closed:
                return f"the channel of queue {name} is not open"
            if consumer.consumer_tag is None:
                return f"queue {name} has no consumer"
        if self.handoff_channel is None or self.handoff_channel.is_closed:
            return "the handoff channel is not open"
        return None
