"""The consumer: its settings, its plan and its declared messages, until :meth:`Consumer.start`
(docs/design.md, section 2)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypedDict, Unpack

from pymongo import AsyncMongoClient

from .._checks import check_amqp_url, check_bool, check_database_name, check_seconds
from .._engine.wiring import ConsumerSettings, Lifespan
from .._errors import ConfigError
from .._inbox import InboxOptions, MongoScope
from .._outbox import OutboxOptions
from .._plan.options import QueueOptions, RetryPolicy
from .._plan.outgoing import OutgoingMessage
from .._plan.plan import Plan, PlanBuilder
from .._plan.routes import Guard, Middleware
from .._redact import redact_url
from .._supervision import Lifecycle, ShutdownReport, State
from .._tasks import uncancellable as _uncancellable
from .._text import describe_value
from .._topology import destination_options
from ..telemetry import resolve_telemetry
from .managed import ManagedConsumer

if TYPE_CHECKING:
    from ..telemetry import Telemetry

log = logging.getLogger("lily_mongo")


class QueueSettings(TypedDict, total=False):
    """The keyword options of :meth:`Consumer.configure_queue`: every :class:`QueueOptions` field
    but ``name``, with the defaults and bounds documented there."""

    concurrency: int
    prefetch: int
    buffer: int | None
    max_body: int
    retry: RetryPolicy
    queue_type: Literal["classic", "quorum"]
    deadline: float
    cooperation_window: float
    max_deferrals: int
    max_handoff_failures: int
    passive: bool
    unknown_errors: Literal["retryable", "permanent"]
    ack_delay: float
    consumer_timeout: float | None


class Consumer:
    """A RabbitMQ consumer whose handlers may run in MongoDB transactions (docs/design.md, section 2).

    ``mongo_client`` is caller-owned unless ``owns_mongo_client=True``; it is
    never closed otherwise. ``database`` holds the inbox, lease and outbox
    collections and is what ``MongoScope.database`` returns; ``inbox`` and
    ``outbox`` are their options. ``telemetry``:
    traces and metrics through the OpenTelemetry API, on by default when it is
    installed (``False`` turns them off; a :class:`~lily_mongo.telemetry.Telemetry`
    chooses providers), see ``docs/observability.md``. ``lifespan``: a function of the
    consumer returning an async context manager (an ``@asynccontextmanager`` function),
    entered before ``start()`` connects and exited after the shutdown drained and the
    relay stopped; the mapping it yields is what handlers and factories ask for with
    ``Resource(name)`` (docs/handlers.md).
    ``mongo_check_timeout``: how long :meth:`start` waits for the MongoDB server to answer
    before it fails, in one line (docs/lifecycle.md, section 2).
    """

    def __init__(
        self,
        *,
        amqp_url: str | Sequence[str],
        name: str,
        mongo_client: AsyncMongoClient[Any] | None = None,
        database: str | None = None,
        confirm_timeout: float = 10.0,
        graceful_timeout: float = 30.0,
        force_timeout: float = 5.0,
        inbox: InboxOptions | None = None,
        owns_mongo_client: bool = False,
        telemetry: bool | Telemetry = True,
        lifespan: Lifespan | None = None,
        mongo_check_timeout: float = 10.0,
        outbox: OutboxOptions | None = None,
    ) -> None:
        amqp_url = check_amqp_url("amqp_url", amqp_url)
        if lifespan is not None and not callable(lifespan):
            raise ConfigError(
                "lifespan must be a function of the consumer returning an async context manager "
                f"(an @asynccontextmanager function), got {describe_value(lifespan)}"
            )
        if mongo_client is not None and not isinstance(mongo_client, AsyncMongoClient):
            motor = type(mongo_client).__module__.split(".")[0] == "motor"
            hint = "; Motor gave way to PyMongo's own async API: see docs/migrating.md, 'From Motor'" if motor else ""
            raise ConfigError(
                f"mongo_client must be a pymongo.AsyncMongoClient, got {describe_value(mongo_client)}{hint}"
            )
        if mongo_client is None:
            given_without = (
                ("database", database),
                ("inbox", inbox),
                ("outbox", outbox),
                ("owns_mongo_client", owns_mongo_client),
            )
            for field_name, given in given_without:
                if given is not None and given is not False:
                    raise ConfigError(f"{field_name} needs a mongo_client, got {describe_value(given)} without one")
        else:
            check_database_name("database", database)
        if inbox is not None and not isinstance(inbox, InboxOptions):
            raise ConfigError(f"inbox must be an InboxOptions, got {describe_value(inbox)}")
        if outbox is not None and not isinstance(outbox, OutboxOptions):
            raise ConfigError(f"outbox must be an OutboxOptions, got {describe_value(outbox)}")
        inbox, outbox = inbox or InboxOptions(), outbox or OutboxOptions()
        if inbox.records == outbox.collection:
            raise ConfigError(
                f"InboxOptions.records and OutboxOptions.collection must differ, both are {inbox.records!r:.60}"
            )
        check_bool("owns_mongo_client", owns_mongo_client)
        self._settings = ConsumerSettings(
            name=name,
            amqp_url=amqp_url,
            mongo_client=mongo_client,
            database=database,
            confirm_timeout=check_seconds("confirm_timeout", confirm_timeout, low=0, high=3600, low_inclusive=False),
            graceful_timeout=check_seconds("graceful_timeout", graceful_timeout, low=0, high=3600, low_inclusive=False),
            force_timeout=check_seconds("force_timeout", force_timeout, low=0, high=3600, low_inclusive=False),
            inbox=inbox,
            owns_mongo_client=owns_mongo_client,
            telemetry=resolve_telemetry(telemetry),
            lifespan=lifespan,
            mongo_check_timeout=check_seconds(
                "mongo_check_timeout", mongo_check_timeout, low=0, high=600, low_inclusive=False
            ),
            outbox=outbox,
        )
        self._builder = PlanBuilder(name=name, has_mongo=mongo_client is not None)
        self._outgoing: list[OutgoingMessage] = []
        self._lifecycle = Lifecycle()
        self.name = name

    def __repr__(self) -> str:
        return f"<Consumer name={self.name!r} amqp={redact_url(self._settings.amqp_url)!r} state={self.state}>"

    @property
    def state(self) -> str:
        """The lifecycle state: new, starting, running, draining, forcing or stopped."""
        return self._lifecycle.state.value

    @property
    def settings(self) -> ConsumerSettings:
        """The consumer's settings (frozen): what a started consumer, or a test consumer, runs with."""
        return self._settings

    def configure_queue(self, name: str, **options: Unpack[QueueSettings]) -> QueueOptions:
        """Set a physical queue's options (see :class:`QueueOptions`); bounds checked now."""
        self._require_new()
        queue_options = QueueOptions(name=name, **options)
        self._builder.configure_queue(queue_options)
        return queue_options

    def sends(
        self,
        routing_key: str,
        *,
        version: int,
        content: str = "json",
        payload: Any = None,
        exchange: str = "",
        declare: bool = False,
    ) -> OutgoingMessage:
        """Declare a message this service publishes (through ``mongo.outbox`` or a ``Publisher``).

        The AsyncAPI document describes it as a ``send`` operation (with ``payload``'s
        JSON Schema for json content). ``start()`` declares its destination queue when
        ``declare=True``, and otherwise logs a warning if the broker has nowhere to route it.
        """
        self._require_new()
        message = OutgoingMessage(
            routing_key=routing_key,
            version=version,
            content=content,
            payload=payload,
            exchange=exchange,
            declare=declare,
        )
        if any(known.key == message.key for known in self._outgoing):
            raise ConfigError(f"sends({routing_key!r:.60}, version={version}, content={content!r}) is declared twice")
        if declare:
            destination_options(message)  # the queue name's bound, checked now
        self._outgoing.append(message)
        return message

    @property
    def outgoing(self) -> tuple[OutgoingMessage, ...]:
        """The messages declared with :meth:`sends`, in declaration order."""
        return tuple(self._outgoing)

    def include(self, *handlers: Callable[..., Awaitable[None]]) -> None:
        """Link ``@queue`` handlers into the plan."""
        self._require_new()
        for handler in handlers:
            self._builder.include(handler)

    def use(self, middleware: Middleware) -> None:
        """Add consumer-wide middleware (outermost first)."""
        self._require_new()
        self._builder.middleware.append(middleware)

    def guard(self, guard: Guard) -> None:
        """Add a consumer-wide guard (runs before every handler)."""
        self._require_new()
        self._builder.guards.append(guard)

    def plan(self) -> Plan:
        """Check the registrations against every bound and return the plan."""
        return self._builder.build(MongoScope)

    def _require_new(self) -> None:
        if self._lifecycle.state is not State.NEW:
            raise ConfigError(f"the consumer is {self.state}; configure it before start()")

    async def start(self) -> ManagedConsumer:
        """Declare the topology, prepare the inbox and attach consumers; return the running consumer."""
        self._require_new()
        plan = self.plan()
        self._lifecycle.enter(State.STARTING)
        managed = ManagedConsumer(
            self._settings, plan, outgoing=self.outgoing, lifecycle=self._lifecycle, consumer=self
        )
        try:
            await managed._start()
        except BaseException:
            # Cancelled or failed mid-start: tear down what started before propagating.
            await _uncancellable(managed._teardown_after_failed_start())
            raise
        return managed

    async def run(self) -> ShutdownReport:
        """Run until the awaiting task is cancelled; then shut down gracefully and re-raise."""
        return await self.run_with_cancellation(asyncio.Event())

    async def run_with_cancellation(self, event: asyncio.Event) -> ShutdownReport:
        """Run until ``event`` is set (graceful shutdown) or the awaiting task is cancelled."""
        managed = await self.start()
        waiter = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({waiter, managed._supervisor}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await _uncancellable(managed.shutdown())
            raise
        finally:
            waiter.cancel()
        # The supervisor owns cleanup: a cancel arriving now waits for it, then propagates.
        return await _uncancellable(managed.shutdown())
