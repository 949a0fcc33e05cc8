"""The backstop relay as a service of its own, for processes that run no consumer (docs/outbox.md).

:class:`Relay` is what ``lily-mongo relay`` runs: it claims due outbox records in
batches, publishes them pipelined with confirms and marks them, until it is asked
to stop. A graceful stop lets the batch in flight finish (published and marked);
a forced one cancels it (its claims expire and another relay publishes those
records again: at least once). Several relays, and the consumers' own relays, may
run against one outbox at once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from pymongo import AsyncMongoClient
from pymongo.errors import PyMongoError

from .._amqp import channel_errors, connect_amqp
from .._checks import check_amqp_url, check_bool, check_database_name, check_seconds
from .._errors import ConfigError, LilyError
from .._mongo import mongo_error
from .._observer import NO_OBSERVER, Observer
from .._progress import Progress
from .._redact import redact_url
from .._signals import ShutdownSignals, graceful_notice
from .._snapshots import Snapshot
from .._supervision import ShutdownAction, ShutdownReport, State
from .._tasks import TaskSet
from .._tasks import uncancellable as _uncancellable
from .._text import describe_value
from ..telemetry import resolve_telemetry
from .options import OutboxOptions, standalone_options
from .process import ProcessOutbox

if TYPE_CHECKING:
    import aio_pika.abc

    from ..telemetry import Telemetry

__all__ = ["Relay"]


class Relay:
    """The outbox's backstop relay, alone: ``start()``/``shutdown()``, ``run()``, or ``async with``.

    ``mongo_client`` is caller-owned unless ``owns_mongo_client=True``. ``options`` names the
    outbox collection and the relay's batch size, poll interval, claim length, attempts and
    backoff (``run_relay`` does not apply: this is the relay). A graceful shutdown waits at most
    ``graceful_timeout`` for the batch in flight, a forced one at most ``force_timeout``.
    """

    def __init__(
        self,
        mongo_client: AsyncMongoClient[Any],
        database: str,
        *,
        amqp_url: str | Sequence[str],
        options: OutboxOptions | None = None,
        name: str = "lily-relay",
        confirm_timeout: float = 10.0,
        graceful_timeout: float = 30.0,
        force_timeout: float = 5.0,
        telemetry: bool | Telemetry = True,
        owns_mongo_client: bool = False,
    ) -> None:
        if not isinstance(mongo_client, AsyncMongoClient):
            raise ConfigError(f"mongo_client must be a pymongo.AsyncMongoClient, got {describe_value(mongo_client)}")
        check_database_name("database", database)
        amqp_url = check_amqp_url("amqp_url", amqp_url)
        options = standalone_options(options, name)
        self._client = mongo_client
        self._url = amqp_url
        self._options = options
        self.name = name
        self._confirm_timeout = check_seconds("confirm_timeout", confirm_timeout, low=0, high=3600, low_inclusive=False)
        self._graceful_timeout = check_seconds(
            "graceful_timeout", graceful_timeout, low=0, high=3600, low_inclusive=False
        )
        self._force_timeout = check_seconds("force_timeout", force_timeout, low=0, high=3600, low_inclusive=False)
        self._owns_client = check_bool("owns_mongo_client", owns_mongo_client)
        self._telemetry = resolve_telemetry(telemetry)
        observer: Observer = self._telemetry or NO_OBSERVER
        self._process = ProcessOutbox(
            mongo_client, database, options, owner=f"{name[:64]}:{uuid.uuid4().hex[:12]}", observer=observer
        )
        self._tasks = TaskSet()
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._state = State.NEW
        self._stop_requested = asyncio.Event()
        self._force_requested = asyncio.Event()
        self._supervisor: asyncio.Future[ShutdownReport] | None = None
        self._unwatch: Callable[[], None] = _nothing
        self._progress = Progress(self._published, "outbox records")
        self._transport: object | None = None  # the last connection transport seen
        self._generations = 0  # the transport generation: one more for each new connection transport

    def __repr__(self) -> str:
        return f"<Relay name={self.name!r} amqp={redact_url(self._url)!r} state={self.state}>"

    async def __aenter__(self) -> Relay:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Leaving ``async with Relay(...) as relay:`` shuts it down gracefully."""
        await self.shutdown()

    # -- what it shows ----------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """new, starting, running, draining, forcing or stopped."""
        return self._state.value

    @property
    def ready(self) -> bool:
        """True while running with its channel open (a readiness probe)."""
        return self.not_ready_because() is None

    def not_ready_because(self) -> str | None:
        """Why :attr:`ready` is False, in words (the state, or the relay's channel), or None."""
        if self._state is not State.RUNNING:
            return str(self._state.value)
        return None if self._process.ready else "the relay's channel is not open"

    @property
    def telemetry(self) -> Telemetry | None:
        return self._telemetry

    @property
    def queue_names(self) -> tuple[str, ...]:
        """A relay consumes no queue (its snapshot has no queue entries)."""
        return ()

    @property
    def process(self) -> ProcessOutbox:
        """The relay's outbox parts (for the library's own tests)."""
        return self._process

    def _published(self) -> dict[str, int]:
        counters = self._process.counters
        return {"published": counters.published, "unroutable": counters.unroutable}

    def _generation(self) -> int:
        """1 for the first connection transport, one more for each new one (0 before any connection)."""
        transport = getattr(self._connection, "transport", None)
        if transport is not None and transport is not self._transport:
            self._transport = transport
            self._generations += 1
        return self._generations

    def snapshot(self) -> Snapshot:
        """The outbox counts: pending and failed (refreshed every ``count_interval``), published, unroutable."""
        return Snapshot(self.state, self._generation(), (), **self._process.counters.figures())

    # -- start, run, stop ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to RabbitMQ, read the server's clock, create (or verify) the indexes, start relaying."""
        if self._state is not State.NEW:
            raise LilyError(f"the relay is {self.state}; a relay starts once")
        self._state = State.STARTING
        try:
            self._connection = await connect_amqp(self._url)
            try:
                await self._process.prepare()
            except PyMongoError as exc:
                raise mongo_error(exc, "the relay set-up") from exc
            with channel_errors("starting the relay"):
                await self._process.start(
                    self._connection, self._confirm_timeout, self._tasks, dispatch=False, relay=True
                )
        except BaseException:
            await _uncancellable(self._teardown())
            raise
        if self._telemetry is not None:
            self._unwatch = self._telemetry.watch(lambda: (self.snapshot(), ()))
        self._state = State.RUNNING
        self._tasks.spawn(self._progress.run(), name="lily-relay-progress")
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise(), name="lily-relay-supervisor")

    async def run(self) -> ShutdownReport:
        """Start and relay until the awaiting task is cancelled (or a shutdown is requested); then stop."""
        await self.start()
        try:
            return await self.wait()
        except asyncio.CancelledError:
            await _uncancellable(self.shutdown())
            raise

    async def wait(self) -> ShutdownReport:
        """Wait for the relay to stop; cancelling this waiter stops nothing."""
        if self._supervisor is None:
            raise LilyError("the relay was not started")
        return await asyncio.shield(self._supervisor)

    async def shutdown(self, *, force: bool = False) -> ShutdownReport:
        """Request a graceful (or forced) stop and wait for its report."""
        self._stop_requested.set()
        if force:
            self._force_requested.set()
        return await self.wait()

    @property
    def shutdown_requested(self) -> bool:
        return self._stop_requested.is_set()

    def request_shutdown(self) -> None:
        """Ask for a graceful stop without waiting (e.g. from a signal handler)."""
        self._stop_requested.set()

    def request_force(self) -> None:
        """Escalate to a forced stop without waiting (e.g. on a second signal)."""
        self._stop_requested.set()
        self._force_requested.set()

    def install_signal_handlers(self, loop: asyncio.AbstractEventLoop | None = None) -> Callable[[], None]:
        """SIGTERM/SIGINT, the rule ``lily-mongo run`` follows: the first → graceful stop; one at least
        1 s later → force (a burst counts once, docs/lifecycle.md section 8). Returns an uninstaller."""
        signals = ShutdownSignals(
            self.request_shutdown, self.request_force, notice=graceful_notice(self._graceful_timeout)
        )
        return signals.install(loop)

    async def _supervise(self) -> ShutdownReport:
        await self._stop_requested.wait()
        self._state = State.DRAINING
        actions: list[ShutdownAction] = []
        forced = False
        process = self._process

        started = time.monotonic()
        stopping = asyncio.ensure_future(process.stop(self._graceful_timeout))
        forcing = asyncio.ensure_future(self._force_requested.wait())
        try:
            await asyncio.wait({stopping, forcing}, return_when=asyncio.FIRST_COMPLETED)
            if not stopping.done():
                forced = True
                self._state = State.FORCING
                process.relay.force()
                await asyncio.wait({stopping}, timeout=self._force_timeout)
        finally:
            forcing.cancel()
        if stopping.done() and not stopping.cancelled() and stopping.exception() is None:
            actions.append(ShutdownAction("relay_stop", True, stopping.result(), None, time.monotonic() - started))
        else:
            error = "did not stop in time" if not stopping.done() else repr(stopping.exception())[:300]
            actions.append(ShutdownAction("relay_stop", False, False, error, time.monotonic() - started))
        actions += await self._close_steps()
        self._state = State.STOPPED
        return ShutdownReport(
            actions=tuple(actions),
            settled={},
            unresolved=0,
            forced=forced,
            succeeded=all(a.ok and a.observed for a in actions),
            totals=self._published(),
            elapsed=self._progress.elapsed(),
        )

    async def _close_steps(self) -> list[ShutdownAction]:
        actions: list[ShutdownAction] = []
        connection = self._connection

        async def step(name: str, run: Callable[[], Awaitable[bool]]) -> None:
            started = time.monotonic()
            try:
                observed = await run()
            except Exception as exc:
                actions.append(
                    ShutdownAction(name, False, False, f"{type(exc).__name__}: {exc}"[:300], time.monotonic() - started)
                )
                return
            actions.append(ShutdownAction(name, True, observed, None, time.monotonic() - started))

        if connection is not None:

            async def connection_close() -> bool:
                await connection.close()
                return bool(connection.is_closed)

            await step("connection_close", connection_close)

        async def tasks_join() -> bool:
            leftovers = self._tasks.pending()
            for task in leftovers:
                task.cancel()
            return not await self._tasks.join(leftovers, self._force_timeout)

        await step("tasks_join", tasks_join)
        if self._owns_client:
            client = self._client

            async def mongo_close() -> bool:
                await client.close()
                return True

            await step("mongo_client_close", mongo_close)
        self._unwatch()
        return actions

    async def _teardown(self) -> None:
        """After a failed start: stop what started, close the connection (and an owned client)."""
        try:
            await self._process.stop(1.0)
            await self._close_steps()
        finally:
            self._state = State.STOPPED


def _nothing() -> None:
    return None
