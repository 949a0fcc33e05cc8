"""Dispatch after commit: a committed transaction's records published from memory, marked in batches
(docs/outbox.md)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from pymongo.write_concern import WriteConcern

from .._clock import Clock, aware, utcnow
from .._observer import NO_OBSERVER, Observer
from .._tasks import TaskSet
from . import protocol
from .options import OutboxOptions
from .outcomes import Breaker, OutboxCounters, write_outcomes
from .protocol import Claim, Failure
from .publishing import Transport, publish_batch

if TYPE_CHECKING:
    from pymongo.asynchronous.collection import AsyncCollection
log = logging.getLogger("lily_mongo")

# The dispatcher holds at most this many committed records in memory, and this many bytes of
# their bodies; past either, a transaction's records wait for a relay instead.
DISPATCH_QUEUE_LIMIT = 10_000
DISPATCH_QUEUE_BYTES = 64 * 1024 * 1024
# Marks lag when the oldest unwritten one has less than mark_interval plus this much claim left
# (a quarter of claim_seconds, at most MARK_MARGIN_MAX): dispatch then pauses until they catch up.
MARK_MARGIN_MAX = 2.0
MARK_PAUSE_POLL = 0.05

# -- dispatch after commit --------------------------------------------------------------------------


class OutboxDispatcher:
    """Publishes committed records from memory right after their commit; marks them in batches.

    One per process. Its claim token is on every record its writers insert while it
    runs (:meth:`claim`); a relay takes a record only once that claim expired or was
    released after a failed publish.
    """

    def __init__(
        self,
        collection: AsyncCollection[Any],
        options: OutboxOptions,
        owner: str,
        counters: OutboxCounters,
        *,
        observer: Observer = NO_OBSERVER,
        clock: Clock = utcnow,
    ) -> None:
        # Its marks and failure records are majority-acknowledged, whatever the client's default
        # (docs/outbox.md, "What it costs: commands per record").
        self._majority = collection.with_options(write_concern=WriteConcern("majority"))
        self._options = options
        self._owner = owner
        self.counters = counters  # what it did, shared with the process's relay (the snapshot's figures)
        self._observer = observer
        self._clock = clock
        self.token = uuid.uuid4().hex
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._queued_bytes = 0
        self._wake = asyncio.Event()
        self._mark_wake = asyncio.Event()
        self._progress = asyncio.Event()
        self._marks: list[str] = []
        # The claim expiry of the oldest record whose mark is not written yet (pending or in flight).
        self._oldest_mark: datetime.datetime | None = None
        self._writing_oldest: datetime.datetime | None = None
        self._marked = asyncio.Event()
        self._failures: list[tuple[Any, Failure]] = []
        self._marks_since: float | None = None
        self._publishing = False
        self._flushing = False
        self._flush_now = 0
        self._running = False
        self._tasks: list[asyncio.Task[Any]] = []
        self._breaker = Breaker(options)

    @property
    def running(self) -> bool:
        return self._running

    def claim(self) -> Claim | None:
        """The claim a new transaction's records are born with, or None while the dispatcher is not running."""
        if not self._running:
            return None
        expires = self._clock() + datetime.timedelta(seconds=self._options.claim_seconds)
        return Claim(self._owner, self.token, expires)

    def submit(self, records: list[dict[str, Any]]) -> None:
        """A committed transaction's records (claimed by this dispatcher): publish them now, in order.

        While the broker is away the queue stops growing at :data:`DISPATCH_QUEUE_LIMIT`
        records or :data:`DISPATCH_QUEUE_BYTES` of bodies: a transaction's records past it
        stay in MongoDB, claimed until the claim expires, and a relay publishes them.
        """
        if not self._running or not records:
            return
        size = sum(len(record["body"]) for record in records)
        if self._queue and (
            len(self._queue) + len(records) > DISPATCH_QUEUE_LIMIT or self._queued_bytes + size > DISPATCH_QUEUE_BYTES
        ):
            self.counters.left_to_relay(len(records), "the dispatch queue is full (is the broker reachable?)")
            return
        self._queued_bytes += size
        committed = utcnow()
        for record in records:
            record["committed_at"] = committed  # in memory only: the relay-lag histogram starts here
        self._queue.extend(records)
        self._wake.set()

    def start(self, transport: Transport, tasks: TaskSet) -> None:
        """Start publishing and marking, tasks of the supervisor's."""
        self._running = True
        self._tasks = [
            tasks.spawn(self._publish_loop(transport), name="lily-outbox-dispatch"),
            tasks.spawn(self._mark_loop(), name="lily-outbox-marks"),
        ]

    def _busy(self) -> bool:
        return bool(self._queue or self._publishing or self._marks or self._failures or self._flushing)

    async def drain(self) -> None:
        """Wait until every submitted record is published (or failed) and its mark written."""
        self._flush_now += 1
        self._mark_wake.set()
        try:
            while True:
                self._progress.clear()
                if not self._busy() or not self._running:
                    return
                await self._progress.wait()
        finally:
            self._flush_now -= 1

    async def stop(self, timeout: float) -> bool:
        """Publish and mark what was submitted (within ``timeout``), then stop; True if the tasks ended.

        Records still in memory after that stay claimed until their claim expires; a relay publishes them.
        """
        if self._running:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.drain(), timeout)
        self._running = False
        for task in self._tasks:
            task.cancel()
        pending: set[asyncio.Task[Any]] = set()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=max(timeout, 0.1))
        self._tasks = []
        self._queue.clear()
        self._queued_bytes = 0
        return not pending

    async def _publish_loop(self, transport: Transport) -> None:
        batch_size = self._options.batch_size
        while True:
            if not self._queue:
                self._wake.clear()
                self._progress.set()
                await self._wake.wait()
                continue
            if self._marks_lag():
                await self._let_marks_catch_up()
                continue
            batch = [self._queue.popleft() for _ in range(min(batch_size, len(self._queue)))]
            self._queued_bytes -= sum(len(record["body"]) for record in batch)
            self._publishing = True
            try:
                await self._dispatch(batch, transport)
            except Exception:  # a bug, not a record's failure: those records expire to a relay
                log.exception("outbox dispatch failed; the records are left to the relay")
            finally:
                self._publishing = False
                self._progress.set()

    async def _dispatch(self, batch: list[dict[str, Any]], transport: Transport) -> None:
        # Publish a record only if its claim outlasts the confirm and the mark: one that runs out
        # sooner (a long transaction, a wait for the broker) is the relay's, and publishing it
        # here too could publish it twice. Asked once the channel is there (docs/outbox.md).
        margin = transport.timeout + self._options.mark_interval
        clock = self._clock

        def keep(record: dict[str, Any]) -> bool:
            return protocol.claim_lasts(record, clock(), margin)

        # While the broker blocks the connection (an alarm), publish nothing: wait, counted, at most
        # as long as a claim lasts; records whose claim then runs out are the relay's (docs/outbox.md).
        self.counters.blocked_seconds += await transport.unblocked(self._options.claim_seconds)
        results = await publish_batch(batch, transport, self._observer, via="dispatch", keep=keep)
        counters = self.counters
        settled = counters.settle(batch, results, self._breaker)
        if settled.marks and self._oldest_mark is None:
            # The batch's first record was committed first: its claim is (about) the oldest.
            self._oldest_mark = aware(batch[0].get("claim_expires"))
        self._marks += settled.marks
        self._failures += settled.failures
        if settled.left:
            counters.left_to_relay(settled.left, "their claim would run out before the confirm and the mark")
        if self._marks or self._failures:
            if self._marks_since is None:
                self._marks_since = time.monotonic()
            self._mark_wake.set()
        if settled.pause:
            # The batch failed only on transport: the next one waits (a circuit breaker's open state).
            await asyncio.sleep(settled.pause)

    def _marks_lag(self) -> bool:
        """The oldest mark not yet written nears its claim's end: its mark may land after a relay took it."""
        oldest = min((t for t in (self._oldest_mark, self._writing_oldest) if t is not None), default=None)
        if oldest is None:
            return False
        return oldest - self._clock() < datetime.timedelta(seconds=self._mark_margin)

    @property
    def _mark_margin(self) -> float:
        options = self._options
        return options.mark_interval + min(options.claim_seconds / 4, MARK_MARGIN_MAX)

    async def _let_marks_catch_up(self) -> None:
        """Publish nothing until the marks catch up (records kept waiting may then be the relay's)."""
        self._mark_wake.set()
        self._marked.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._marked.wait(), MARK_PAUSE_POLL)

    async def _mark_loop(self) -> None:
        options = self._options
        while True:
            if not self._marks and not self._failures:
                self._mark_wake.clear()
                self._progress.set()
                await self._mark_wake.wait()
                continue
            # Wait for a full batch, the mark interval, a drain, or marks that lag: one write for many records.
            since = self._marks_since if self._marks_since is not None else time.monotonic()
            while len(self._marks) < options.batch_size and not self._flush_now and not self._marks_lag():
                remaining = since + options.mark_interval - time.monotonic()
                if remaining <= 0:
                    break
                self._mark_wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._mark_wake.wait(), remaining)
            # Every pending mark at once: chunks of batch_size, several writes in flight (write_outcomes).
            marks, self._marks = self._marks, []
            failures, self._failures = self._failures, []
            self._writing_oldest, self._oldest_mark = self._oldest_mark, None
            self._marks_since = None
            self._flushing = True
            try:
                await write_outcomes(self._majority, self.counters, options, self.token, marks, failures, self._clock())
            finally:
                self._writing_oldest = None
                self._flushing = False
                self._marked.set()
                self._progress.set()
