"""A started consumer: its supervisor owns every resource and every task until shutdown completes
(docs/lifecycle.md)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import aio_pika.abc

from .._amqp import channel_errors, connect_amqp
from .._engine.engine import Engine
from .._engine.intake import AmqpIntake
from .._engine.wiring import ConsumerSettings, Wiring, enter_lifespan, wire
from .._mongo import check_mongo
from .._outbox import ProcessOutbox
from .._plan.outgoing import OutgoingMessage
from .._plan.plan import Plan
from .._progress import Progress, outcome_totals
from .._signals import ShutdownSignals, graceful_notice
from .._snapshots import Snapshot, TerminalObservation
from .._supervision import Lifecycle, ShutdownReport, State
from .._tasks import TaskSet, raise_if_cancel_requested
from .._topology import declare_topology, prepare_destinations
from .shutdown import ShutdownSequence

if TYPE_CHECKING:
    from ..telemetry import Telemetry

log = logging.getLogger("lily_mongo")


class ManagedConsumer:
    """A started consumer. Its supervisor owns cleanup; waiters only observe."""

    def __init__(
        self,
        settings: ConsumerSettings,
        plan: Plan,
        *,
        outgoing: tuple[OutgoingMessage, ...] = (),
        lifecycle: Lifecycle | None = None,
        consumer: object = None,
    ) -> None:
        """``lifecycle``: the state holder of the :class:`Consumer` starting it (a fresh one, starting, if None);
        ``consumer``: that consumer, what its lifespan is called with."""
        self._settings = settings
        self._consumer = consumer
        self._lifespan = contextlib.AsyncExitStack()  # the lifespan's exit, once entered
        self._outgoing = outgoing
        self._lifecycle = lifecycle if lifecycle is not None else Lifecycle(State.STARTING)
        self.plan = plan
        self._tasks = TaskSet()
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._wiring: Wiring | None = None
        self._stop_requested = asyncio.Event()
        self._force_requested = asyncio.Event()
        self._graceful_timeout = settings.graceful_timeout
        self._force_timeout = settings.force_timeout
        self._supervisor: asyncio.Task[ShutdownReport] = asyncio.get_running_loop().create_future()  # type: ignore[assignment]
        self._progress = Progress(lambda: outcome_totals(self.snapshot()), "deliveries")

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
    def _engine(self) -> Engine | None:
        """The engine once built (for the library's own tests)."""
        return self._wiring.engine if self._wiring is not None else None

    @property
    def _intake(self) -> AmqpIntake | None:
        """The AMQP intake once built (for the library's own tests)."""
        return self._wiring.intake if self._wiring is not None else None

    @property
    def _outbox(self) -> ProcessOutbox | None:
        """The process's outbox once built (for the library's own tests)."""
        return self._wiring.outbox if self._wiring is not None else None

    @property
    def ready(self) -> bool:
        """True while running with every queue consumed and every consuming channel and the handoff channel
        open (False while starting, reconnecting, consuming a queue again after the broker cancelled its
        consumer, draining or stopped): a readiness probe."""
        return self.not_ready_because() is None

    def not_ready_because(self) -> str | None:
        """Why :attr:`ready` is False, in words (the state, or what a running consumer waits for), or None."""
        state: State = self._lifecycle.state
        if state is not State.RUNNING:
            return str(state.value)
        wiring = self._wiring
        return "starting" if wiring is None else wiring.waiting_for()

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
        self._wiring = await wire(
            self._settings,
            self.plan,
            self._tasks,
            state=lambda: self.state,
            connection=self._connection,
            resources=resources,
        )
        # What the AMQP client raises while channels open and consumers attach, mapped at the boundary.
        with channel_errors("starting the consumer"):
            await self._wiring.start(self._tasks)
        raise_if_cancel_requested()  # a cancel the AMQP library absorbed on the way still stops the start
        self._lifecycle.enter(State.RUNNING)
        self._tasks.spawn(self._progress.run(), name="lily-progress")  # cancelled, and said last, at tasks_join
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise(), name="lily-supervisor")

    async def _teardown_after_failed_start(self) -> None:
        wiring = self._wiring
        try:
            if wiring is not None:
                if wiring.intake is not None:
                    await wiring.intake.stop()
                if wiring.outbox is not None:
                    await wiring.outbox.stop(1.0)
            for task in self._tasks.pending():
                task.cancel()
            await self._tasks.join(self._tasks.pending(), 5.0)
            if self._connection is not None:
                await self._connection.close()
            if self._settings.owns_mongo_client and self._settings.mongo_client is not None:
                await self._settings.mongo_client.close()
            if wiring is not None:
                wiring.unwatch()
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
        if self._wiring is None:
            return Snapshot(self.state, 0, ())
        return self._wiring.snapshot(self.state)

    def delivery_terminal_observations(self) -> tuple[TerminalObservation, ...]:
        """The last <= 4096 terminal outcomes, oldest first (may include event ids)."""
        return self._wiring.engine.observations.items() if self._wiring is not None else ()

    # -- the supervisor -----------------------------------------------------------------

    async def _supervise(self) -> ShutdownReport:
        await self._stop_requested.wait()
        return await self._shutdown_sequence()

    async def _shutdown_sequence(self) -> ShutdownReport:
        assert self._wiring is not None
        assert self._connection is not None
        sequence = ShutdownSequence(
            self._wiring,
            self._connection,
            self._tasks,
            self._lifecycle,
            self._lifespan,
            force_requested=self._force_requested,
        )
        report = await sequence.run()
        return dataclasses.replace(report, totals=outcome_totals(self.snapshot()), elapsed=self._progress.elapsed())
