"""A consumer's engine, wired in one place for a started consumer and a test consumer alike.

:func:`build_engine` makes the parts from a consumer's frozen settings: with a
MongoDB client, the outbox relay and the inbox (whose commits wake the relay),
their collections prepared and the inbox heartbeat started; the runtime; and
the telemetry hook-up (the observer every part reports to, and the snapshot the
observable metrics read). Then :meth:`Engine.start` consumes on an AMQP
connection (:class:`~lily_mongo.ManagedConsumer`), or :meth:`Engine.open_in_process`
lets an in-process transport feed the runtime (:class:`~lily_mongo.testing.TestConsumer`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aio_pika.abc
from pymongo import AsyncMongoClient
from pymongo.errors import PyMongoError

from ._mongo import mongo_error
from ._observer import NO_OBSERVER, Observer
from ._tasks import TaskSet
from .inbox import Inbox, InboxOptions
from .observe import Snapshot
from .outbox import OutboxRelay
from .runtime import Handoff, Runtime

if TYPE_CHECKING:
    from .plan import Plan
    from .telemetry import Telemetry

__all__ = ["ConsumerSettings", "Engine", "build_engine"]


@dataclass(frozen=True, slots=True)
class ConsumerSettings:
    """Everything a started consumer needs from its :class:`~lily_mongo.Consumer`, fixed at start."""

    name: str
    amqp_url: str
    mongo_client: AsyncMongoClient[Any] | None
    database: str | None
    confirm_timeout: float
    graceful_timeout: float
    force_timeout: float
    inbox: InboxOptions
    owns_mongo_client: bool
    telemetry: Telemetry | None = None


def _nothing() -> None:
    return None


@dataclass(slots=True, eq=False)
class Engine:
    """One consumer's engine parts; ``unwatch`` stops the metrics reading its snapshot."""

    settings: ConsumerSettings
    runtime: Runtime
    inbox: Inbox | None
    relay: OutboxRelay | None
    unwatch: Callable[[], None] = _nothing

    def snapshot(self, state: str) -> Snapshot:
        """The consumer's bounded aggregate state, in lifecycle state ``state``."""
        runtime, relay = self.runtime, self.relay
        return Snapshot(
            state=state,
            transport_generation=runtime.generation,
            queues=runtime.snapshots(),
            outbox_pending=relay.pending if relay else None,
            outbox_failed=relay.failed if relay else None,
            outbox_published=relay.published if relay else 0,
            outbox_unroutable=relay.unroutable if relay else 0,
        )

    async def start(self, connection: aio_pika.abc.AbstractConnection, tasks: TaskSet) -> None:
        """Consume on ``connection`` (the runtime's own); relay outbox records unless another process does."""
        runtime = self.runtime
        if isinstance(connection, aio_pika.abc.AbstractRobustConnection):
            connection.reconnect_callbacks.add(lambda *_: runtime.on_reconnect())
        await runtime.start()
        if self.relay is not None and self.settings.inbox.run_relay:
            await self.relay.start(connection, self.settings.confirm_timeout, tasks)

    def open_in_process(self) -> None:
        """Accept deliveries through :meth:`Runtime.deliver` (no AMQP; the relay is drained by hand)."""
        self.runtime.open_in_process()


async def build_engine(
    settings: ConsumerSettings,
    plan: Plan,
    tasks: TaskSet,
    *,
    state: Callable[[], str],
    connection: aio_pika.abc.AbstractConnection | None = None,
    handoff: Handoff | None = None,
) -> Engine:
    """The parts of the consumer ``settings`` describes, running ``plan`` with ``tasks`` as their tasks.

    ``state`` returns the lifecycle state the snapshot reports. ``connection`` is the AMQP
    connection to consume from; None for an in-process transport, which publishes the
    retry and DLQ copies through ``handoff``.
    """
    observer: Observer = settings.telemetry or NO_OBSERVER
    inbox: Inbox | None = None
    relay: OutboxRelay | None = None
    client = settings.mongo_client
    if client is not None:
        assert settings.database is not None
        options = settings.inbox
        relay = OutboxRelay(
            client[settings.database][options.outbox],
            options.relay,
            f"{settings.name[:64]}:{uuid.uuid4().hex[:12]}",
            observer=observer,
        )
        inbox = Inbox(
            client,
            settings.database,
            options,
            owner_prefix=settings.name,
            deadlines={name: queue.deadline for name, queue in plan.queues.items()},
            on_outbox_commit=relay.wake,
            observer=observer,
        )
        try:
            await inbox.prepare()
            await relay.prepare(passive=options.passive_indexes)
        except PyMongoError as exc:
            raise mongo_error(exc, "the inbox set-up") from exc
        inbox.start(tasks)
    runtime = Runtime(
        plan,
        connection,
        tasks,
        inbox=inbox,
        confirm_timeout=settings.confirm_timeout,
        handoff=handoff,
        observer=observer,
    )
    engine = Engine(settings, runtime, inbox, relay)
    names = tuple(plan.queues)
    # Observable instruments read the snapshot when collected.
    engine.unwatch = observer.watch(lambda: (engine.snapshot(state()), names))
    return engine
