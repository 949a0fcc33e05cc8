"""A consumer's parts, wired in one place for a started consumer and a test consumer alike.

:func:`wire` makes the parts from a consumer's frozen settings: with a MongoDB
client, the process's outbox (writers, the dispatcher that publishes a
transaction's records right after its commit, the backstop relay) and the inbox
(whose committed attempts hand their records to the dispatcher), their
collections prepared and the inbox heartbeat started; the engine; with an AMQP
connection, the intake that feeds it; and the telemetry hook-up (the observer
every part reports to, and the snapshot the observable metrics read). Then
:meth:`Wiring.start` consumes on the AMQP connection (:class:`~lily_mongo.ManagedConsumer`),
or :meth:`Wiring.open_in_process` lets an in-process transport feed the engine
(:class:`~lily_mongo.testing.TestConsumer`).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import aio_pika.abc
from pymongo import AsyncMongoClient
from pymongo.errors import PyMongoError

from .._errors import ConfigError
from .._inbox import Inbox, InboxOptions
from .._mongo import mongo_error
from .._observer import NO_OBSERVER, Observer
from .._outbox import OutboxOptions, ProcessOutbox, Send
from .._snapshots import Snapshot
from .._tasks import TaskSet
from .._text import describe_value
from .dispatch import Services
from .engine import Engine
from .intake import AmqpIntake
from .message import Handoff

if TYPE_CHECKING:
    from .._plan.plan import Plan
    from ..telemetry import Telemetry

__all__ = ["ConsumerSettings", "Lifespan", "Wiring", "enter_lifespan", "wire"]

Lifespan = Callable[[Any], contextlib.AbstractAsyncContextManager[Mapping[str, Any] | None]]
"""``lifespan(consumer)``: an async context manager (an ``@asynccontextmanager`` function) whose
value is the mapping of resources handlers ask for with ``Resource(name)`` (docs/handlers.md)."""


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
    lifespan: Lifespan | None = None
    mongo_check_timeout: float = 10.0
    outbox: OutboxOptions = field(default_factory=OutboxOptions)


def _nothing() -> None:
    return None


@dataclass(slots=True, eq=False)
class Wiring:
    """One consumer's parts: the engine, its AMQP intake (None in process), the inbox and the process's
    outbox (None without a MongoDB client); ``unwatch`` stops the metrics reading its snapshot."""

    settings: ConsumerSettings
    engine: Engine
    intake: AmqpIntake | None
    inbox: Inbox | None
    outbox: ProcessOutbox | None
    unwatch: Callable[[], None] = _nothing

    def snapshot(self, state: str) -> Snapshot:
        """The consumer's bounded aggregate state, in lifecycle state ``state``."""
        engine = self.engine
        snapshot = Snapshot(state, engine.generation, engine.snapshots())
        if self.outbox is None:
            return snapshot
        return replace(snapshot, **self.outbox.counters.figures())

    async def start(self, tasks: TaskSet) -> None:
        """Consume on the intake's connection. The outbox starts first, on a connection of its own
        (docs/outbox.md), so the first commit already has a dispatcher; its relay runs unless
        ``OutboxOptions.run_relay`` is off."""
        intake = self.intake
        assert intake is not None
        if self.outbox is not None:
            await self.outbox.start_connected(self.settings.amqp_url, self.settings.confirm_timeout, tasks)
        await intake.start(self.engine)

    def ready(self) -> bool:
        """True while every queue has its consumer, every consuming channel and the handoff channel is open."""
        return self.intake is not None and self.intake.ready()

    def waiting_for(self) -> str | None:
        """What readiness waits for, in words (None when ready; :meth:`AmqpIntake.waiting_for`)."""
        return "the broker connection" if self.intake is None else self.intake.waiting_for()

    def open_in_process(self, tasks: TaskSet, outbox_send: Send | None = None) -> None:
        """Accept deliveries through :meth:`Engine.deliver` (no AMQP). With ``outbox_send``, committed
        outbox records are dispatched through it; no relay runs (it is drained by hand)."""
        if self.outbox is not None and outbox_send is not None:
            self.outbox.start_in_process(outbox_send, tasks)
        self.engine.open()


async def wire(
    settings: ConsumerSettings,
    plan: Plan,
    tasks: TaskSet,
    *,
    state: Callable[[], str],
    connection: aio_pika.abc.AbstractConnection | None = None,
    handoff: Handoff | None = None,
    resources: Mapping[str, Any] | None = None,
) -> Wiring:
    """The parts of the consumer ``settings`` describes, running ``plan`` with ``tasks`` as their tasks.

    ``state`` returns the lifecycle state the snapshot reports. ``connection`` is the AMQP
    connection to consume from; None for an in-process transport, which publishes the
    retry and DLQ copies through ``handoff``. ``resources``: what the lifespan yielded
    (:func:`enter_lifespan`), for the handlers' ``Resource`` parameters.
    """
    observer: Observer = settings.telemetry or NO_OBSERVER
    inbox: Inbox | None = None
    outbox: ProcessOutbox | None = None
    client = settings.mongo_client
    if client is not None:
        assert settings.database is not None
        outbox = ProcessOutbox(
            client,
            settings.database,
            settings.outbox,
            owner=f"{settings.name[:64]}:{uuid.uuid4().hex[:12]}",
            observer=observer,
        )
        inbox = Inbox(
            client,
            settings.database,
            settings.inbox,
            owner_prefix=settings.name,
            outbox=outbox,
            deadlines={name: queue.deadline for name, queue in plan.queues.items()},
            observer=observer,
        )
        try:
            await inbox.prepare()
            await outbox.prepare()
        except PyMongoError as exc:
            raise mongo_error(exc, "the inbox set-up") from exc
        inbox.start(tasks)
    services = Services(
        database=client[settings.database] if client is not None and settings.database is not None else None,
        resources=MappingProxyType(dict(resources or {})),
    )
    intake = None
    if connection is not None:
        intake = AmqpIntake(connection, confirm_timeout=settings.confirm_timeout)
        handoff = intake.handoff
    assert handoff is not None, "an in-process transport publishes the handoff copies itself"
    engine = Engine(plan, tasks, inbox=inbox, handoff=handoff, observer=observer, services=services)
    wiring = Wiring(settings, engine, intake, inbox, outbox)
    names = tuple(plan.queues)
    # Observable instruments read the snapshot when collected.
    wiring.unwatch = observer.watch(lambda: (wiring.snapshot(state()), names))
    return wiring


async def enter_lifespan(
    lifespan: Lifespan | None, consumer: object, plan: Plan, stack: contextlib.AsyncExitStack
) -> Mapping[str, Any]:
    """Enter ``lifespan(consumer)`` on ``stack`` (its exit is the stack's) and return its resources.

    Every ``Resource`` name the plan's handlers and factories ask for must be among them:
    a missing one is a :class:`ConfigError` now, naming it and who asks for it, not a
    failure at the first delivery.
    """
    if lifespan is None:
        resources: Mapping[str, Any] = {}
    else:
        manager = lifespan(consumer)
        if not isinstance(manager, contextlib.AbstractAsyncContextManager):
            raise ConfigError(
                "lifespan(consumer) must return an async context manager (write it as an "
                f"@asynccontextmanager function), got {describe_value(manager)}"
            )
        value = await stack.enter_async_context(manager)
        if value is None:
            resources = {}
        elif isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
            resources = value
        else:
            raise ConfigError(
                "the lifespan must yield a mapping of resource names to values (or nothing), "
                f"got {describe_value(value)}"
            )
    for handler in plan.handlers:
        for name, where in handler.resources:
            if name not in resources:
                if lifespan is None:
                    provided = "the consumer has no lifespan: Consumer(..., lifespan=...)"
                else:
                    provided = "it yielded " + (", ".join(repr(k) for k in sorted(resources)[:20]) or "nothing")
                raise ConfigError(
                    f"{where} asks for Resource({name!r}), which the consumer's lifespan does not provide ({provided})"
                )
    return resources
