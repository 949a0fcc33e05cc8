"""A started consumer's shutdown, step by step (docs/lifecycle.md, section 6).

Stop intake, drain within the graceful window, then (only if the drain did not
settle everything) force: a notice that cancels handlers but keeps settlement
authority for a cooperative window, then revocation, observed joins and every
unsettled delivery reported unresolved. Then the outbox and relay, the channels,
the connection, the remaining tasks, the lifespan and an owned MongoDB client.
Each step is timed and reported (:class:`~lily_mongo.ShutdownReport`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from types import MappingProxyType

import aio_pika.abc

from .._engine.settlement import Terminal
from .._engine.wiring import Wiring
from .._errors import LilyError
from .._supervision import Lifecycle, ShutdownReport, ShutdownSteps, State
from .._tasks import TaskSet

__all__ = ["ShutdownSequence"]


class ShutdownSequence:
    """One consumer's shutdown: its steps in order, their report."""

    def __init__(
        self,
        wiring: Wiring,
        connection: aio_pika.abc.AbstractConnection,
        tasks: TaskSet,
        lifecycle: Lifecycle,
        lifespan: contextlib.AsyncExitStack,
        *,
        force_requested: asyncio.Event,
    ) -> None:
        self._wiring = wiring
        self._engine = wiring.engine
        self._connection = connection
        self._tasks = tasks
        self._lifecycle = lifecycle
        self._lifespan = lifespan
        self._force_requested = force_requested
        self._graceful_timeout = wiring.settings.graceful_timeout
        self._force_timeout = wiring.settings.force_timeout

    async def run(self) -> ShutdownReport:
        wiring, settings = self._wiring, self._wiring.settings
        steps = ShutdownSteps()
        self._lifecycle.enter(State.DRAINING)
        await steps.run("stop_intake", self._stop_intake)
        forced = not await steps.run("drain", self._drain)
        if forced:
            self._lifecycle.enter(State.FORCING)
            await steps.run("force", self._force)
        if wiring.outbox is not None:
            await steps.run("relay_stop", self._stop_outbox)
        if wiring.intake is not None:
            await steps.run("channel_close", wiring.intake.close_channels)
        await steps.run("connection_close", self._close_connection)
        await steps.run("tasks_join", self._join_tasks)
        self._engine.failures.flush()  # the handler failures whose tracebacks were not shown, counted
        if settings.lifespan is not None:
            await steps.run("lifespan_exit", self._exit_lifespan)
        if settings.owns_mongo_client and settings.mongo_client is not None:
            await steps.run("mongo_client_close", self._close_client)
        return self._report(steps, forced)

    async def _stop_intake(self) -> bool:
        intake = self._wiring.intake
        errors = await intake.stop() if intake is not None else []
        if errors:
            raise LilyError(f"{len(errors)} consumer cancellation(s) failed: {type(errors[0]).__name__}")
        return True

    async def _drain(self) -> bool:
        engine = self._engine
        wait_for = asyncio.ensure_future(self._force_requested.wait())
        try:
            deadline = time.monotonic() + self._graceful_timeout
            while engine.unsettled() and not self._force_requested.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                await asyncio.wait(
                    {*engine.unsettled(), wait_for}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
        finally:
            wait_for.cancel()
        return not engine.unsettled()

    async def _force(self) -> bool:
        engine = self._engine
        # The notice: cancel handler executions, but keep settlement authority
        # for a cooperative window so work finishing now may still settle.
        engine.force_notice()
        pending = await self._tasks.join(engine.unsettled(), self._force_timeout)
        # Then revoke authority and cancel what is left; observe the joins.
        engine.revoke()
        if self._wiring.intake is not None:
            self._wiring.intake.revoke()
        for task in pending:
            task.cancel()
        still = await self._tasks.join(pending, self._force_timeout)
        # Whatever could not settle is reported unresolved, never as ACKed.
        engine.abandon_unfinished()
        return not still

    async def _stop_outbox(self) -> bool:
        # Every delivery has settled: dispatch and mark what their commits handed over, then
        # stop the relay after its batch.
        outbox = self._wiring.outbox
        assert outbox is not None
        return await outbox.stop(self._force_timeout)

    async def _close_connection(self) -> bool:
        await self._connection.close()
        return bool(self._connection.is_closed)

    async def _join_tasks(self) -> bool:
        # Whatever is still running (a handler dropped at its deadline that ignores
        # cancellation, a heartbeat) is cancelled and its end observed, or reported.
        leftovers = self._tasks.pending()
        for task in leftovers:
            task.cancel()
        return not await self._tasks.join(leftovers, self._force_timeout)

    async def _exit_lifespan(self) -> bool:
        # After the drain, the relay and every task: no handler can use a resource any more.
        await self._lifespan.aclose()
        return True

    async def _close_client(self) -> bool:
        client = self._wiring.settings.mongo_client
        assert client is not None
        await client.close()
        return True

    def _report(self, steps: ShutdownSteps, forced: bool) -> ShutdownReport:
        settled: collections.Counter[str] = self._engine.settled_during_shutdown
        unresolved = settled.get(Terminal.UNRESOLVED.value, 0)
        self._wiring.unwatch()
        self._lifecycle.enter(State.STOPPED)
        succeeded = unresolved == 0 and all(a.ok and a.observed for a in steps.actions if a.name != "drain")
        return ShutdownReport(
            actions=tuple(steps.actions),
            settled=MappingProxyType(dict(settled)),
            unresolved=unresolved,
            forced=forced,
            succeeded=succeeded,
        )
