"""The backstop relay: due records claimed in batches, published pipelined, marked in one write
(docs/outbox.md)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import bson
from bson.codec_options import CodecOptions
from bson.raw_bson import RawBSONDocument
from pymongo import ReadPreference, UpdateOne
from pymongo.errors import PyMongoError
from pymongo.write_concern import WriteConcern

from .._clock import Clock, utcnow
from .._mongo import ensure_index
from .._observer import NO_OBSERVER, Observer
from .._tasks import TaskSet
from . import protocol
from .options import OutboxOptions
from .outcomes import WARNING_INTERVAL, Breaker, OutboxCounters, write_outcomes
from .publishing import ChannelTransport, FixedTransport, Send, Transport, publish_batch

if TYPE_CHECKING:
    import aio_pika.abc
    from pymongo.asynchronous.collection import AsyncCollection
log = logging.getLogger("lily_mongo")

# The snapshot's counts stop at this many records each: a count walks its index keys, and a
# backlog larger than this shows as this figure (docs/outbox.md, "The backstop relay").
COUNT_LIMIT = 100_000
# Beyond the longest wait a writer or a relay sets (claim_seconds, backoff_max), this much more
# (clocks of several processes) makes a claim or an availability implausible: it counts as passed.
HORIZON_SLACK = 10.0
# A claimed batch holds at most about this many bytes of records in memory (as the dispatcher's queue).
RELAY_BATCH_BYTES = 64 * 1024 * 1024

# -- the backstop relay -----------------------------------------------------------------------------


class OutboxRelay:
    """The backstop relay: claims due records in batches, publishes them pipelined, marks them in one write.

    One per consumer (``OutboxOptions.run_relay``), per :class:`Outbox` with ``amqp_url``,
    or alone (:class:`~lily_mongo.Relay`, ``lily-mongo relay``); owned by its supervisor.
    Idle, it costs one command per ``poll_interval`` and one count per ``count_interval``.
    """

    def __init__(
        self,
        collection: AsyncCollection[Any],
        options: OutboxOptions,
        owner: str,
        *,
        observer: Observer = NO_OBSERVER,
        counters: OutboxCounters | None = None,
        clock: Clock = utcnow,
    ) -> None:
        self._collection = collection
        self._majority = collection.with_options(write_concern=WriteConcern("majority"))
        # The read-back after a claim: from the primary (a secondary may not have the claim yet),
        # undecoded, so that one record that cannot be decoded fails alone (:meth:`_decode`).
        self._read_back = collection.with_options(
            read_preference=ReadPreference.PRIMARY, codec_options=CodecOptions(document_class=RawBSONDocument)
        )
        self._codec = collection.codec_options
        self._observer = observer
        self._options = options
        self._owner = owner
        self._clock = clock
        # What it did, for the snapshot (shared with the process's dispatcher).
        self.counters = counters if counters is not None else OutboxCounters(options)
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[Any] | None = None
        self._channel: aio_pika.abc.AbstractChannel | None = None
        self._claim_warned = -WARNING_INTERVAL
        self._breaker = Breaker(options)
        self._horizon = max(options.claim_seconds, options.backoff_max) + HORIZON_SLACK

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def channel_open(self) -> bool:
        return self._channel is not None and not self._channel.is_closed

    async def prepare(self, *, passive: bool) -> None:
        """Create the outbox's indexes (idempotent), or only verify them in passive mode."""
        # Only pending records are in it: the published ones (kept for the retention, the bulk of the
        # collection) cost the claim query nothing.
        await ensure_index(
            self._collection,
            "lily_outbox_due",
            [("status", 1), ("available_at", 1), ("seq", 1)],
            passive=passive,
            partialFilterExpression={"status": protocol.PENDING},
        )
        # Parked records, for their count (and an operator's query): a handful, never the published bulk.
        await ensure_index(
            self._collection,
            "lily_outbox_failed",
            [("status", 1)],
            passive=passive,
            partialFilterExpression={"status": protocol.FAILED},
        )
        await ensure_index(
            self._collection, "lily_expires_at_ttl", [("expires_at", 1)], passive=passive, expireAfterSeconds=0
        )

    async def start(self, connection: aio_pika.abc.AbstractConnection, confirm_timeout: float, tasks: TaskSet) -> None:
        """Open the relay's confirming channel and start relaying, a task of the supervisor's."""
        if self._options.claim_seconds < 2 * confirm_timeout:
            # A batch holds its claim while its publishes wait for their confirms, then marks: a claim
            # shorter than that lets another relay take the batch and publish it again.
            log.warning(
                "outbox relay: OutboxOptions.claim_seconds (%g s) is less than twice the confirm timeout (%g s): "
                "a batch whose confirms are slow may be claimed and published again by another relay",
                self._options.claim_seconds,
                confirm_timeout,
            )
        self._channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        self._task = tasks.spawn(self.run(ChannelTransport(self._channel, confirm_timeout)), name="lily-relay")

    async def stop(self, timeout: float) -> bool:
        """Stop after the in-flight batch is published and marked, or ``timeout`` ends; True if the relay ended.

        A batch cut short keeps its claim until it expires; another relay then publishes it.
        """
        self._stopping = True
        self._wake.set()
        task = self._task
        ended = True
        if task is not None:
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if not done:
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=timeout)
            ended = bool(done)
        if self._channel is not None and not self._channel.is_closed:
            await self._channel.close()
        return ended

    def force(self) -> None:
        """Cancel the batch in flight (a forced stop): its claims expire and another relay takes those records."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()

    def wake(self) -> None:
        """Run a relay pass now."""
        self._wake.set()

    async def run(self, transport: Transport) -> None:
        """Relay until stopped: claim a batch, publish it pipelined, mark it; poll when idle."""
        options = self._options
        next_count = 0.0
        while not self._stopping:
            if time.monotonic() >= next_count:
                await self.refresh_counts()
                next_count = time.monotonic() + options.count_interval
            batch: list[dict[str, Any]] = []
            # While the broker blocks the connection (an alarm), claim nothing: wait, counted.
            self.counters.blocked_seconds += await transport.unblocked(options.poll_interval)
            if transport.ready:
                # The broker closed the channel (e.g. a record named a missing exchange): the robust
                # channel reopens it; claim nothing meanwhile.
                try:
                    batch = await self._claim_batch()
                except Exception:  # the database, or a record it cannot hand over (InvalidBSON)
                    self._warn_claim()
            if not batch:
                self._wake.clear()
                if self._stopping:  # stopped while claiming: its wake-up came before the clear
                    break
                wait = min(options.poll_interval, max(next_count - time.monotonic(), 0.0))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=max(wait, 0.001))
                continue
            pause = 0.0
            try:
                pause = await self._relay(batch, transport)
            except Exception:  # a bug, not a record's failure: the batch's claims expire to the next pass
                log.exception("outbox relay: a batch failed; its records are published again once their claim expires")
            if pause and not self._stopping:
                # The batch failed only on transport: wait before the next claim (a circuit breaker).
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=pause)

    async def drain(self, send: Send) -> int:
        """Claim and publish through ``send`` until no record is due; returns how many were published.

        For in-process transports (:class:`lily_mongo.testing.TestConsumer`): the same claim,
        publish and mark steps as :meth:`run`, without a channel.
        """
        transport = FixedTransport(send)
        before = self.counters.published
        while batch := await self._claim_batch():
            await self._relay(batch, transport)
        await self.refresh_counts()
        return self.counters.published - before

    async def refresh_counts(self) -> None:
        """Count pending and failed records, for the snapshot: two counts, each through its partial index
        (a count of both statuses at once would not imply either index's filter, and scan the collection),
        each stopping at :data:`COUNT_LIMIT`."""
        try:
            pending = await self._collection.count_documents({"status": protocol.PENDING}, limit=COUNT_LIMIT)
            failed = await self._collection.count_documents({"status": protocol.FAILED}, limit=COUNT_LIMIT)
        except PyMongoError:
            return
        self.counters.pending, self.counters.failed = pending, failed

    async def _claim_batch(self) -> list[dict[str, Any]]:
        """Claim up to ``batch_size`` due records in three commands; returns them in publishing order."""
        size = self._options.batch_size
        found = await (
            self._collection.find(protocol.due_filter(self._clock(), self._horizon), {"_id": 1})
            .sort(protocol.DUE_SORT)
            .limit(size)
            .batch_size(size)
            .to_list()
        )
        ids = [doc["_id"] for doc in found]
        if not ids:
            return []
        token = uuid.uuid4().hex
        claimed = await self._majority.update_many(
            protocol.claim_filter(ids, self._clock(), self._horizon),
            protocol.claim_update(self._owner, token, claim_seconds=self._options.claim_seconds),
        )
        if not claimed.matched_count:
            return []  # another relay took them all
        raw = await self._read_claimed(ids, token)
        return protocol.publish_order(await self._decode(raw, token))

    async def _read_claimed(self, ids: list[str], token: str) -> list[RawBSONDocument]:
        """The claimed records, read until :data:`RELAY_BATCH_BYTES` of them are in memory (the server
        sends at most 16 MiB a reply); the claims of those not read are released at once, for the next pass."""
        cursor = self._read_back.find(protocol.claimed_filter(ids, token)).batch_size(len(ids))
        raw: list[RawBSONDocument] = []
        size = 0
        try:
            async for document in cursor:
                raw.append(document)
                size += len(document.raw)
                if size >= RELAY_BATCH_BYTES:
                    break
        finally:
            await cursor.close()
        if size >= RELAY_BATCH_BYTES and len(raw) < len(ids):
            read = {_raw_id(bytes(document.raw)) for document in raw}
            unread = [rid for rid in ids if rid not in read]
            await self._majority.update_many(
                protocol.failure_filter({"$in": unread}, token), {"$unset": {"claim_expires": ""}}
            )
        return raw

    async def _decode(self, raw: list[RawBSONDocument], token: str) -> list[dict[str, Any]]:
        """Decode each claimed record on its own; park those that cannot be decoded (a date outside
        Python's range, say), each with its cause: the rest of the batch goes on."""
        records: list[dict[str, Any]] = []
        broken: list[tuple[object, str]] = []
        for document in raw:
            try:
                records.append(bson.decode(document.raw, codec_options=self._codec))
            except Exception as exc:
                record_id = _raw_id(bytes(document.raw))
                cause = f"undecodable record ({type(exc).__name__}: {exc})"
                log.warning("outbox record %r parked as failed: %s", record_id, cause)
                if record_id is not None:
                    broken.append((record_id, cause))
        if broken:
            writes = [
                UpdateOne(protocol.failure_filter(rid, token), protocol.park_update(cause)) for rid, cause in broken
            ]
            try:
                await self._majority.bulk_write(writes, ordered=False)
            except PyMongoError:
                self.counters.marks_lost(len(broken), "parking undecodable records")
        return records

    async def _relay(self, batch: list[dict[str, Any]], transport: Transport) -> float:
        """Publish and settle one claimed batch; the wait before the next (0 unless it failed only on transport)."""
        results = await publish_batch(batch, transport, self._observer, via="relay")
        settled = self.counters.settle(batch, results, self._breaker)
        token = str(batch[0].get("claim_token"))
        await write_outcomes(
            self._majority, self.counters, self._options, token, settled.marks, settled.failures, self._clock()
        )
        return settled.pause

    def _warn_claim(self) -> None:
        now = time.monotonic()
        if now - self._claim_warned >= WARNING_INTERVAL:
            self._claim_warned = now
            log.warning("outbox relay: claiming records failed; retrying every poll", exc_info=True)


def _raw_id(raw: bytes) -> object:
    """The ``_id`` of a BSON document that cannot be decoded whole: its first element (where MongoDB
    keeps ``_id``) when that is a string or an ObjectId, else None."""
    if len(raw) < 12 or raw[5:9] != b"_id\x00":
        return None
    kind, start = raw[4], 9
    if kind == 0x02:  # string: int32 length (with its NUL), the bytes
        length = int.from_bytes(raw[start : start + 4], "little")
        return raw[start + 4 : start + 4 + length - 1].decode("utf-8", "replace")
    if kind == 0x07:  # ObjectId: 12 bytes
        return bson.ObjectId(raw[start : start + 12])
    return None
