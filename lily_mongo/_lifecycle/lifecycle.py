"""The consumer, its supervisor, and shutdown (docs/lifecycle.md).

:class:`Consumer` collects the plan; :meth:`Consumer.start` declares the
topology, attaches consumers and returns a :class:`ManagedConsumer` whose
supervisor task owns every resource and every task until shutdown completes.

Cancellation rules:

* cancelling the task awaiting :meth:`Consumer.start` tears down whatever had
  started, then the cancellation propagates;
* cancelling the task awaiting :meth:`Consumer.run` (or
  :meth:`Consumer.run_with_cancellation`) requests a graceful shutdown, waits
  for it to complete, then propagates;
* cancelling :meth:`ManagedConsumer.wait` or :meth:`ManagedConsumer.shutdown`
  only stops that waiter: the supervisor goes on and can be awaited again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, TypedDict, TypeVar, Unpack

import aio_pika.abc
from pymongo import AsyncMongoClient

from .._amqp import channel_errors, connect_amqp
from .._checks import check_amqp_url, check_bool, check_database_name, check_seconds
from .._engine.engine import Runtime
from .._engine.settlement import Terminal
from .._engine.wiring import ConsumerSettings, Engine, Lifespan, build_engine, enter_lifespan
from .._errors import ConfigError, LilyError
from .._inbox.inbox import InboxOptions, MongoScope
from .._mongo import check_mongo
from .._outbox.outbox import OutboxOptions, OutboxRuntime
from .._plan.outgoing import OutgoingMessage
from .._plan.plan import Guard, Middleware, Plan, PlanBuilder, QueueOptions, RetryPolicy
from .._redact import redact_url
from .._signals import ShutdownSignals, graceful_notice
from .._snapshots import Snapshot, TerminalObservation
from .._tasks import TaskSet, raise_if_cancel_requested
from .._tasks import uncancellable as _uncancellable
from .._text import describe_value
from .._topology import declare_topology, destination_options, prepare_destinations
from ..telemetry import Telemetry, resolve_telemetry

__all__ = ["Consumer", "ConsumerSettings", "ManagedConsumer", "QueueSettings", "ShutdownAction", "ShutdownReport"]

log = logging.getLogger("lily_mongo")
T = TypeVar("T")


class State(enum.Enum):
    """Lifecycle states of a consumer, in order; a consumer starts once."""

    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    FORCING = "forcing"
    STOPPED = "stopped"


_ORDER = {state: position for position, state in enumerate(State)}


class _Lifecycle:
    """The one holder of a consumer's lifecycle state, shared by the :class:`Consumer` and the
    :class:`ManagedConsumer` it starts. The state only moves forward (a failed start moves
    from starting to stopped, a graceful shutdown skips forcing)."""

    __slots__ = ("state",)

    def __init__(self, state: State = State.NEW) -> None:
        self.state = state

    def enter(self, state: State) -> None:
        if _ORDER[state] <= _ORDER[self.state]:
            raise LilyError(f"the consumer cannot go back from {self.state.value} to {state.value}")
        self.state = state


@dataclass(frozen=True, slots=True)
class ShutdownAction:
    """One shutdown step: did it return OK, was the dependency's termination observed."""

    name: str
    ok: bool
    observed: bool
    error: str | None = None
    duration: float = 0.0


@dataclass(frozen=True, slots=True)
class ShutdownReport:
    """What shutdown did. ``succeeded`` only if every step returned OK, every
    termination was observed and no delivery was left unresolved; ``forced`` when the
    graceful window did not settle every delivery; :attr:`graceful` when both went well."""

    actions: tuple[ShutdownAction, ...]
    settled: Mapping[str, int]
    unresolved: int
    forced: bool
    succeeded: bool

    @property
    def graceful(self) -> bool:
        """True when the shutdown succeeded within the graceful window, without forcing: the one outcome
        ``lily-mongo run`` exits 0 after."""
        return self.succeeded and not self.forced

    def action(self, name: str) -> ShutdownAction:
        """The action called ``name`` (KeyError if the shutdown did not run it)."""
        for action in self.actions:
            if action.name == name:
                return action
        raise KeyError(name)

    def render(self) -> str:
        """A human-readable multi-line summary (no endpoints, no credentials)."""
        if self.graceful:
            status = "succeeded"
        elif self.succeeded:  # forced, yet everything settled (after the force notice)
            status = "FORCED"
        else:
            status = "FAILED (forced)" if self.forced else "FAILED"
        lines = [f"shutdown {status}; unresolved deliveries: {self.unresolved}"]
        for a in self.actions:
            status = ("ok" if a.ok else "error") + (", terminated" if a.observed else ", termination NOT observed")
            lines.append(f"  {a.name:<18} {status} ({a.duration:.3f} s){': ' + a.error if a.error else ''}")
        if self.settled:
            lines.append("  settled during shutdown: " + ", ".join(f"{k}={v}" for k, v in sorted(self.settled.items())))
        return "\n".join(lines)


class _Steps:
    def __init__(self) -> None:
        self.actions: list[ShutdownAction] = []

    async def run(self, name: str, step: Callable[[], Awaitable[bool]]) -> bool:
        started = time.monotonic()
        try:
            observed = await step()
        except Exception as exc:
            self.actions.append(
                ShutdownAction(name, False, False, f"{type(exc).__name__}: {exc}"[:300], time.monotonic() - started)
            )
            log.warning("shutdown step %s failed: %s", name, type(exc).__name__, extra={"step": name})
            return False
        self.actions.append(ShutdownAction(name, True, observed, None, time.monotonic() - started))
        # Incomplete: for the drain, the graceful window did not settle everything; for the
        # others, the dependency's termination was not observed.
        log.log(
            logging.INFO if observed else logging.WARNING,
            "shutdown step %s: %s (%.3f s)",
            name,
            "complete" if observed else "incomplete",
            time.monotonic() - started,
            extra={"step": name},
        )
        return observed


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
        amqp_url: str,
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
        check_amqp_url("amqp_url", amqp_url)
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
        self._lifecycle = _Lifecycle()
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


class ManagedConsumer:
    """A started consumer. Its supervisor owns cleanup; waiters only observe."""

    def __init__(
        self,
        settings: ConsumerSettings,
        plan: Plan,
        *,
        outgoing: tuple[OutgoingMessage, ...] = (),
        lifecycle: _Lifecycle | None = None,
        consumer: Consumer | None = None,
    ) -> None:
        """``lifecycle``: the state holder of the :class:`Consumer` starting it (a fresh one, starting, if None);
        ``consumer``: that consumer, what its lifespan is called with."""
        self._settings = settings
        self._consumer = consumer
        self._lifespan = contextlib.AsyncExitStack()  # the lifespan's exit, once entered
        self._outgoing = outgoing
        self._lifecycle = lifecycle if lifecycle is not None else _Lifecycle(State.STARTING)
        self.plan = plan
        self._tasks = TaskSet()
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._engine: Engine | None = None
        self._stop_requested = asyncio.Event()
        self._force_requested = asyncio.Event()
        self._graceful_timeout = settings.graceful_timeout
        self._force_timeout = settings.force_timeout
        self._supervisor: asyncio.Task[ShutdownReport] = asyncio.get_running_loop().create_future()  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<ManagedConsumer name={self._settings.name!r} state={self.state}>"

    async def __aenter__(self) -> ManagedConsumer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Leaving ``async with await consumer.start() as managed:`` shuts down gracefully."""
        await self.shutdown()

    @property
    def state(self) -> str:
        """The lifecycle state: starting, running, draining, forcing or stopped."""
        return self._lifecycle.state.value

    @property
    def _runtime(self) -> Runtime | None:
        """The engine's runtime once built (for the library's own tests)."""
        return self._engine.runtime if self._engine is not None else None

    @property
    def _outbox(self) -> OutboxRuntime | None:
        """The engine's outbox once built (for the library's own tests)."""
        return self._engine.outbox if self._engine is not None else None

    @property
    def ready(self) -> bool:
        """True while running with every consuming channel and the handoff channel open
        (False while starting, reconnecting, draining or stopped): a readiness probe."""
        engine = self._engine
        return self._lifecycle.state is State.RUNNING and engine is not None and engine.runtime.channels_open()

    @property
    def telemetry(self) -> Telemetry | None:
        """The telemetry this consumer reports to, or None when it is off."""
        return self._settings.telemetry

    async def _start(self) -> None:
        settings = self._settings
        if settings.mongo_client is not None:
            assert settings.database is not None
            # Before anything else: an unreachable MongoDB, a refused login or a server without
            # transactions fails the start in one line within the check's timeout.
            await check_mongo(
                settings.mongo_client,
                database=settings.database,
                collection=settings.inbox.records,
                timeout=settings.mongo_check_timeout,
                transactions=any(handler.guarantee == "inbox" for handler in self.plan.handlers),
            )
        # Then the lifespan: its resources exist before anything connects, and a Resource
        # name it does not provide fails the start here (docs/handlers.md, resources).
        resources = await enter_lifespan(settings.lifespan, self._consumer, self.plan, self._lifespan)
        self._connection = await connect_amqp(self._settings.amqp_url)
        for options in self.plan.queues.values():
            await declare_topology(self._connection, options)  # checks for a cancel between declarations
        await prepare_destinations(self._connection, self._outgoing)
        self._engine = await build_engine(
            self._settings,
            self.plan,
            self._tasks,
            state=lambda: self.state,
            connection=self._connection,
            resources=resources,
        )
        # What the AMQP client raises while channels open and consumers attach, mapped at the boundary.
        with channel_errors("starting the consumer"):
            await self._engine.start(self._connection, self._tasks)
        raise_if_cancel_requested()  # a cancel the AMQP library absorbed on the way still stops the start
        self._lifecycle.enter(State.RUNNING)
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise(), name="lily-supervisor")

    async def _teardown_after_failed_start(self) -> None:
        engine = self._engine
        try:
            if engine is not None:
                await engine.runtime.stop_intake()
                if engine.outbox is not None:
                    await engine.outbox.stop(1.0)
            for task in self._tasks.pending():
                task.cancel()
            await self._tasks.join(self._tasks.pending(), 5.0)
            if self._connection is not None:
                await self._connection.close()
            if self._settings.owns_mongo_client and self._settings.mongo_client is not None:
                await self._settings.mongo_client.close()
            if engine is not None:
                engine.unwatch()
        finally:
            try:
                await self._lifespan.aclose()  # after a failed start too: it was entered first
            except Exception:
                log.warning("the lifespan's exit failed after a failed start", exc_info=True)
            self._lifecycle.enter(State.STOPPED)

    # -- observers ----------------------------------------------------------------------

    async def wait(self) -> ShutdownReport:
        """Wait for the supervisor to finish; cancelling this waiter stops nothing."""
        return await asyncio.shield(self._supervisor)

    async def shutdown(self, *, force: bool = False) -> ShutdownReport:
        """Request a graceful (or, with ``force``, an immediate forced) shutdown and wait for its report.

        Cancelling the task awaiting this does not cancel the supervisor.
        """
        self._stop_requested.set()
        if force:
            self._force_requested.set()
        return await asyncio.shield(self._supervisor)

    def request_shutdown(self) -> None:
        """Ask for a graceful shutdown without waiting (e.g. from a signal handler)."""
        self._stop_requested.set()

    def request_force(self) -> None:
        """Escalate to a forced shutdown without waiting (e.g. on a second signal)."""
        self._stop_requested.set()
        self._force_requested.set()

    @property
    def shutdown_requested(self) -> bool:
        """True once a shutdown was requested (by a signal, :meth:`shutdown` or :meth:`request_shutdown`)."""
        return self._stop_requested.is_set()

    def install_signal_handlers(self, loop: asyncio.AbstractEventLoop | None = None) -> Callable[[], None]:
        """SIGTERM/SIGINT: the first → graceful shutdown; one at least 1 s later → force (a burst counts
        once, docs/lifecycle.md section 8). Returns an uninstaller."""
        signals = ShutdownSignals(
            self.request_shutdown, self.request_force, notice=graceful_notice(self._graceful_timeout)
        )
        return signals.install(loop)

    @property
    def queue_names(self) -> tuple[str, ...]:
        """The plan's physical queues, in plan order (``QueueSnapshot.queue_index``)."""
        return tuple(self.plan.queues)

    def snapshot(self) -> Snapshot:
        """Bounded aggregate state: counts only, never payloads, ids, names or endpoints."""
        if self._engine is None:
            return Snapshot(self.state, 0, (), outbox_pending=None, outbox_failed=None, outbox_published=0)
        return self._engine.snapshot(self.state)

    def delivery_terminal_observations(self) -> tuple[TerminalObservation, ...]:
        """The last <= 4096 terminal outcomes, oldest first (may include event ids)."""
        return self._engine.runtime.observations.items() if self._engine is not None else ()

    # -- the supervisor -----------------------------------------------------------------

    async def _supervise(self) -> ShutdownReport:
        await self._stop_requested.wait()
        return await self._shutdown_sequence()

    async def _shutdown_sequence(self) -> ShutdownReport:
        engine = self._engine
        assert engine is not None
        assert self._connection is not None
        runtime = engine.runtime
        steps = _Steps()
        self._lifecycle.enter(State.DRAINING)

        async def stop_intake() -> bool:
            errors = await runtime.stop_intake()
            if errors:
                raise LilyError(f"{len(errors)} consumer cancellation(s) failed: {type(errors[0]).__name__}")
            return True

        await steps.run("stop_intake", stop_intake)

        async def drain() -> bool:
            wait_for = asyncio.ensure_future(self._force_requested.wait())
            try:
                deadline = time.monotonic() + self._graceful_timeout
                while runtime.unsettled() and not self._force_requested.is_set():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    await asyncio.wait(
                        {*runtime.unsettled(), wait_for}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                    )
            finally:
                wait_for.cancel()
            return not runtime.unsettled()

        forced = not await steps.run("drain", drain)
        if forced:
            self._lifecycle.enter(State.FORCING)

            async def force() -> bool:
                # The notice: cancel handler executions, but keep settlement authority
                # for a cooperative window so work finishing now may still settle.
                runtime.force_notice()
                pending = await self._tasks.join(runtime.unsettled(), self._force_timeout)
                # Then revoke authority and cancel what is left; observe the joins.
                runtime.revoke()
                for task in pending:
                    task.cancel()
                still = await self._tasks.join(pending, self._force_timeout)
                # Whatever could not settle is reported unresolved, never as ACKed.
                runtime.abandon_unfinished()
                return not still

            await steps.run("force", force)
        if engine.outbox is not None:
            outbox = engine.outbox

            async def relay_stop() -> bool:
                # Every delivery has settled: dispatch and mark what their commits handed over, then
                # stop the relay after its batch.
                return await outbox.stop(self._force_timeout)

            await steps.run("relay_stop", relay_stop)

        await steps.run("channel_close", runtime.close_channels)
        connection = self._connection

        async def connection_close() -> bool:
            await connection.close()
            return bool(connection.is_closed)

        await steps.run("connection_close", connection_close)

        async def tasks_join() -> bool:
            # Whatever is still running (a handler dropped at its deadline that ignores
            # cancellation, a heartbeat) is cancelled and its end observed, or reported.
            leftovers = self._tasks.pending()
            for task in leftovers:
                task.cancel()
            return not await self._tasks.join(leftovers, self._force_timeout)

        await steps.run("tasks_join", tasks_join)
        runtime.failures.flush()  # the handler failures whose tracebacks were not shown, counted
        if self._settings.lifespan is not None:

            async def lifespan_exit() -> bool:
                # After the drain, the relay and every task: no handler can use a resource any more.
                await self._lifespan.aclose()
                return True

            await steps.run("lifespan_exit", lifespan_exit)
        settings = self._settings
        if settings.owns_mongo_client and settings.mongo_client is not None:
            client = settings.mongo_client

            async def mongo_close() -> bool:
                await client.close()
                return True

            await steps.run("mongo_client_close", mongo_close)
        settled: collections.Counter[str] = runtime.settled_during_shutdown
        unresolved = settled.get(Terminal.UNRESOLVED.value, 0)
        engine.unwatch()
        self._lifecycle.enter(State.STOPPED)
        succeeded = unresolved == 0 and all(a.ok and a.observed for a in steps.actions if a.name not in ("drain",))
        return ShutdownReport(
            actions=tuple(steps.actions),
            settled=MappingProxyType(dict(settled)),
            unresolved=unresolved,
            forced=forced,
            succeeded=succeeded,
        )
