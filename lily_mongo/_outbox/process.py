"""One process's outbox: writers for its transactions, the dispatcher after commit, the backstop relay."""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pymongo import AsyncMongoClient
from yarl import URL

from .._amqp import connect_amqp
from .._clock import utcnow
from .._mongo import server_clock_offset
from .._mongo.transactions import majority_reads
from .._nodes import join_nodes, split_nodes
from .._observer import NO_OBSERVER, Observer
from .._tasks import TaskSet
from .dispatcher import OutboxDispatcher
from .options import OutboxOptions
from .outcomes import OutboxCounters
from .publishing import ChannelTransport, FixedTransport, Send
from .relay import OutboxRelay
from .writer import OutboxWriter, WriterSettings

if TYPE_CHECKING:
    import aio_pika.abc
    from pymongo.asynchronous.client_session import AsyncClientSession
    from pymongo.asynchronous.collection import AsyncCollection
log = logging.getLogger("lily_mongo")

# How often a running outbox reads the server's clock again (one ``hello``).
CLOCK_INTERVAL = 30.0


def outbox_url(url: str) -> str:
    """``url`` for the outbox's own connection: its connection name (``name=``, what the broker's
    management lists) says it is the outbox's, ``<name> (outbox)``, or ``lily-mongo outbox``; a
    cluster's host list stays one (docs/deployment.md, "Clusters")."""
    named = []
    for node in split_nodes(url):
        parsed = URL(node)
        name = parsed.query.get("name")
        named.append(str(parsed.update_query(name=f"{name} (outbox)" if name else "lily-mongo outbox")))
    return named[0] if len(named) == 1 else join_nodes(named)


# -- one process's outbox ---------------------------------------------------------------------------


class ProcessOutbox:
    """One process's outbox: writers for its transactions, the dispatcher after commit, the backstop relay.

    Built by a consumer's engine, by :class:`Outbox` and by :class:`~lily_mongo.Relay`.
    ``clock()`` is the server's clock as :meth:`read_clock` last read it plus the time
    elapsed since on this process's monotonic clock: a step of the wall clock (NTP, a
    resumed VM) moves no claim and no backoff (records are inserted without ``$$NOW``).
    It is read by :meth:`prepare` and again every :data:`CLOCK_INTERVAL` seconds.
    """

    def __init__(
        self,
        client: AsyncMongoClient[Any],
        database: str,
        options: OutboxOptions,
        *,
        owner: str,
        observer: Observer = NO_OBSERVER,
    ) -> None:
        self._client = client
        self.options = options
        self.collection: AsyncCollection[Any] = client[database][options.collection]
        # The read that decides an unknown commit: majority read concern, from the primary.
        self.read_backs = majority_reads(self.collection)
        self._observer = observer
        self._server_at = utcnow()  # the server's time at ...
        self._read_at = time.monotonic()  # ... this monotonic time
        self.clock_read = False
        self.counters = OutboxCounters(options)
        self.dispatcher = OutboxDispatcher(
            self.collection, options, owner, self.counters, observer=observer, clock=self.clock
        )
        self.relay = OutboxRelay(
            self.collection, options, owner, observer=observer, counters=self.counters, clock=self.clock
        )
        self._writers = WriterSettings(self.collection, options.max_body, observer, self.clock, self.dispatcher.claim)
        self._dispatch_channel: aio_pika.abc.AbstractChannel | None = None
        self._connection: aio_pika.abc.AbstractConnection | None = None  # owned, when opened here
        self._relaying = False
        self._clock_task: asyncio.Task[None] | None = None

    def clock(self) -> datetime.datetime:
        return self._server_at + datetime.timedelta(seconds=time.monotonic() - self._read_at)

    @property
    def clock_stale(self) -> bool:
        """Not read yet, or read more than :data:`CLOCK_INTERVAL` seconds ago."""
        return not self.clock_read or time.monotonic() - self._read_at >= CLOCK_INTERVAL

    async def prepare(self, *, indexes: bool = True) -> None:
        """Read the server's clock (``hello``'s ``localTime``) and create (or verify) the indexes."""
        await self.read_clock()
        if indexes:
            await self.relay.prepare(passive=self.options.passive_indexes)

    async def read_clock(self) -> None:
        """Read the offset of this process's clock to the server's: records carry times from :meth:`clock`,
        and a relay compares them with its own corrected clock."""
        offset = await server_clock_offset(self._client)
        self._server_at, self._read_at = utcnow() + offset, time.monotonic()
        self.clock_read = True

    async def _clock_loop(self) -> None:
        while True:
            await asyncio.sleep(CLOCK_INTERVAL)
            try:
                await self.read_clock()
            except Exception:  # the database is away: keep the last reading, which goes on ticking
                log.debug("outbox: reading the server's clock failed", exc_info=True)

    def writer(self, session: AsyncClientSession, writer: str, is_open: Callable[[], bool]) -> OutboxWriter:
        """The outbox of one transaction on ``session``; ``writer`` names it in its records (``handler``)."""
        return OutboxWriter(self._writers, session, writer=writer, is_open=is_open)

    def committed(self, writer: OutboxWriter) -> None:
        """``writer``'s transaction committed: hand its records to the dispatcher (it does not wait)."""
        if writer.claim is not None and writer.claim.token == self.dispatcher.token:
            self.dispatcher.submit(writer.records)

    async def start(
        self,
        connection: aio_pika.abc.AbstractConnection,
        confirm_timeout: float,
        tasks: TaskSet,
        *,
        dispatch: bool = True,
        relay: bool | None = None,
    ) -> None:
        """Dispatch after commit on a confirming channel of ``connection``; relay unless ``run_relay`` is off;
        read the server's clock every :data:`CLOCK_INTERVAL` seconds."""
        self._clock_task = tasks.spawn(self._clock_loop(), name="lily-outbox-clock")
        if dispatch:
            margin = confirm_timeout + self.options.mark_interval
            if self.options.claim_seconds < 2 * margin:
                log.warning(
                    "outbox: OutboxOptions.claim_seconds (%g s) is less than twice the confirm timeout plus the "
                    "mark interval (%g s): records whose transaction took longer than %g s are left to the relay "
                    "instead of being published right after the commit",
                    self.options.claim_seconds,
                    margin,
                    max(self.options.claim_seconds - margin, 0.0),
                )
            self._dispatch_channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            self.dispatcher.start(ChannelTransport(self._dispatch_channel, confirm_timeout), tasks)
        if self.options.run_relay if relay is None else relay:
            self._relaying = True
            await self.relay.start(connection, confirm_timeout, tasks)

    async def start_connected(self, url: str, confirm_timeout: float, tasks: TaskSet) -> None:
        """:meth:`start` on a connection of the outbox's own, closed by :meth:`stop`.

        A consumer's outbox publishes so: nothing its publishes meet (a connection the broker
        closes, a ``connection.blocked`` from a memory or disk alarm, which stops the broker
        reading the whole connection) reaches the consumer's deliveries and their ACKs
        (docs/outbox.md, "A bad destination is isolated").
        """
        self._connection = await connect_amqp(outbox_url(url))
        await self.start(self._connection, confirm_timeout, tasks)

    def start_in_process(self, send: Send, tasks: TaskSet) -> None:
        """Dispatch after commit through ``send`` (an in-process transport); no relay runs."""
        self.dispatcher.start(FixedTransport(send), tasks)

    async def dispatched(self) -> None:
        """Wait until every record handed to the dispatcher is published (or failed) and marked."""
        await self.dispatcher.drain()

    @property
    def ready(self) -> bool:
        """The channels this process publishes on are open."""
        dispatching = self._dispatch_channel is None or not self._dispatch_channel.is_closed
        return dispatching and (not self._relaying or (self.relay.channel_open and self.relay.running))

    async def stop(self, timeout: float) -> bool:
        """Dispatch and mark what was committed, stop the relay after its batch; True if both ended."""
        clock, self._clock_task = self._clock_task, None
        if clock is not None:
            clock.cancel()
            await asyncio.wait({clock}, timeout=1.0)
        dispatcher = await self.dispatcher.stop(timeout)
        relay = await self.relay.stop(timeout)
        channel, self._dispatch_channel = self._dispatch_channel, None
        if channel is not None and not channel.is_closed:
            await channel.close()
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close()
        return dispatcher and relay
