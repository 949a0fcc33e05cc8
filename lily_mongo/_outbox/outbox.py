"""The transactional outbox: records written in a transaction, dispatched after its commit, a backstop relay
(docs/outbox.md).

* :class:`OutboxWriter` (a handler's ``mongo.outbox``, ``tx.publish_*`` in
  :meth:`Outbox.transaction`) inserts one record per message in the transaction.
  With a dispatcher running, the record is born claimed by it (owner, token,
  expiry), so no relay publishes it while its writer is dispatching.
* :class:`OutboxDispatcher` takes a committed transaction's records from memory
  right after the commit, publishes them pipelined on one confirming channel
  (many publishes in flight, their confirms awaited together) and marks them
  published in batches, across transactions: one ``update_many`` for many records.
* :class:`OutboxRelay`, the backstop, claims due records in batches (find the ids,
  claim them in one ``update_many`` with a fresh token, read them back),
  publishes them pipelined and marks them in one write. Several relays share the
  work: every write of a claim holder is fenced by its token.
* :class:`OutboxRuntime` is one process's outbox: the writers' factory, the
  dispatcher, the relay and their shared counters.
* :class:`Outbox` is the standalone outbox for code outside handlers:
  ``await outbox.transaction(fn)``.

Every write on the outbox collection outside a transaction is acknowledged by a
majority whatever the client's default; the read that decides an unknown commit
uses majority read concern. The record protocol (filters, updates, the failure
rule, the order) is :mod:`lily_mongo._outbox_protocol`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import enum
import functools
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from pymongo import AsyncMongoClient, UpdateOne
from pymongo.errors import PyMongoError
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from .._amqp import basic_publish, channel_errors, connect_amqp
from .._backoff import backoff
from .._checks import check_amqp_url, check_bool, check_database_name, check_int, check_seconds
from .._errors import CommitOutcomeUnknown, ConfigError, LilyError, PublishError, ScopeClosedError, TransportError
from .._inbox import protocol as inbox_records
from .._lru import Lru
from .._mongo import TransactionScope, discard_server_session, ensure_index, error_labels, mongo_error
from .._observer import NO_OBSERVER, Observer
from .._tasks import TaskSet
from .._text import describe_value
from ..bounds import BOUNDS, utf8_len
from ..publisher import CustomPublishContent, OpenClose, PublishOptions, TypedPublishing, prepare_publication
from ..telemetry import Telemetry, resolve_telemetry
from . import protocol
from .protocol import Claim, Failure

if TYPE_CHECKING:
    import aio_pika.abc
    from pymongo.asynchronous.client_session import AsyncClientSession
    from pymongo.asynchronous.collection import AsyncCollection
    from pymongo.asynchronous.database import AsyncDatabase

__all__ = [
    "Outbox",
    "OutboxCounters",
    "OutboxDispatcher",
    "OutboxOptions",
    "OutboxRelay",
    "OutboxRuntime",
    "OutboxTransaction",
    "OutboxWriter",
    "Send",
]

log = logging.getLogger("lily_mongo")
T = TypeVar("T")
Clock = Callable[[], datetime.datetime]


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


# -- options --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboxOptions:
    """The outbox collection, its records' bound, how they are dispatched, relayed, retried and kept.

    Used by :class:`~lily_mongo.Consumer` (``outbox=``), :class:`Outbox` and
    :class:`~lily_mongo.Relay`; every bound is checked here (docs/configuration.md).
    """

    collection: str = "lily_outbox"
    max_body: int = BOUNDS.outbox_body_default
    batch_size: int = 100
    poll_interval: float = 1.0
    claim_seconds: float = 30.0
    mark_interval: float = 1.0
    max_attempts: int = 10
    backoff_base: float = 0.5
    backoff_max: float = 60.0
    published_retention: float = 7 * 24 * 3600.0
    count_interval: float = 5.0
    run_relay: bool = True
    passive_indexes: bool = False
    transaction_retries: int = 5
    commit_retries: int = 3

    def __post_init__(self) -> None:
        name = self.collection
        if not isinstance(name, str) or not 0 < utf8_len(name) <= 120 or "$" in name or "\x00" in name:
            raise ConfigError(
                f"OutboxOptions.collection must be a collection name of 1..120 bytes without $, "
                f"got {describe_value(name)}"
            )
        check_int("OutboxOptions.max_body", self.max_body, 1, BOUNDS.outbox_body_max)
        check_int("OutboxOptions.batch_size", self.batch_size, 1, 1000)
        # A poll period near zero is a busy loop against the database; a backoff cap below
        # its base would shorten every delay to the cap.
        seconds = {
            "poll_interval": check_seconds("OutboxOptions.poll_interval", self.poll_interval, low=0.01, high=3600),
            "claim_seconds": check_seconds("OutboxOptions.claim_seconds", self.claim_seconds, low=0.1, high=86400),
            "mark_interval": check_seconds("OutboxOptions.mark_interval", self.mark_interval, low=0, high=60),
            "backoff_base": check_seconds("OutboxOptions.backoff_base", self.backoff_base, low=0.001, high=3600),
            "published_retention": check_seconds(
                "OutboxOptions.published_retention", self.published_retention, low=60, high=366 * 86400
            ),
            "count_interval": check_seconds("OutboxOptions.count_interval", self.count_interval, low=0.01, high=3600),
        }
        # A dispatched record's mark must land well before its claim expires, or a relay
        # publishes it again although its writer did.
        if seconds["mark_interval"] * 2 > seconds["claim_seconds"]:
            raise ConfigError(
                f"OutboxOptions.mark_interval must be at most half of claim_seconds ({self.claim_seconds!r}), "
                f"got {self.mark_interval!r}"
            )
        check_int("OutboxOptions.max_attempts", self.max_attempts, 1, 1000)
        seconds["backoff_max"] = check_seconds("OutboxOptions.backoff_max", self.backoff_max, low=0.001, high=86400)
        if seconds["backoff_max"] < seconds["backoff_base"]:
            raise ConfigError(
                f"OutboxOptions.backoff_max must be >= backoff_base ({self.backoff_base!r}), got {self.backoff_max!r}"
            )
        check_bool("OutboxOptions.run_relay", self.run_relay)
        check_bool("OutboxOptions.passive_indexes", self.passive_indexes)
        check_int("OutboxOptions.transaction_retries", self.transaction_retries, 0, 100)
        check_int("OutboxOptions.commit_retries", self.commit_retries, 0, 100)
        for field_name, value in seconds.items():
            object.__setattr__(self, field_name, value)


def standalone_options(options: OutboxOptions | None, name: str) -> OutboxOptions:
    """The options of a standalone :class:`Outbox` or :class:`~lily_mongo.Relay` (the defaults when None),
    checked, then its ``name``."""
    if options is None:
        options = OutboxOptions()
    if not isinstance(options, OutboxOptions):
        raise ConfigError(f"options must be an OutboxOptions, got {describe_value(options)}")
    if not isinstance(name, str) or not 0 < utf8_len(name) <= 200:
        raise ConfigError(f"name must be a string of 1..200 bytes, got {describe_value(name)}")
    return options


# Outbox.transaction's waits between re-runs and commit retries (the inbox's defaults, docs/outbox.md).
TRANSACTION_BACKOFF_BASE = 0.02
TRANSACTION_BACKOFF_MAX = 1.0


# -- the writer -----------------------------------------------------------------------------------


class OutboxWriter(TypedPublishing):
    """The outgoing messages of one transaction, inserted in it; valid while its scope is open.

    A handler gets it as ``mongo.outbox``; :class:`OutboxTransaction` wraps one. ``records``
    are the documents inserted, in write order, for the dispatcher once committed.
    """

    __slots__ = (
        "_claim",
        "_clock",
        "_collection",
        "_is_open",
        "_max_body",
        "_next_seq",
        "_observer",
        "_session",
        "_writer",
        "_written_at",
        "claim",
        "records",
    )

    def __init__(
        self,
        collection: AsyncCollection[Any],
        session: AsyncClientSession,
        *,
        writer: str,
        max_body: int,
        is_open: Callable[[], bool],
        observer: Observer = NO_OBSERVER,
        clock: Clock = utcnow,
        claim: Callable[[], Claim | None] | None = None,
    ) -> None:
        self._collection = collection
        self._session = session
        self._writer = writer
        self._max_body = max_body
        self._is_open = is_open
        self._observer = observer
        self._clock = clock
        self._claim = claim
        self._written_at = protocol.EPOCH
        self._next_seq = 0  # taken before the insert's await: concurrent publishes get distinct positions
        self.claim: Claim | None = None
        self.records: list[dict[str, Any]] = []

    def __repr__(self) -> str:
        return f"<OutboxWriter written={len(self.records)} open={self._is_open()}>"

    @property
    def written(self) -> int:
        """How many records this transaction wrote."""
        return len(self.records)

    async def _publish[T](
        self, content: CustomPublishContent[T], routing_key: str, payload: T, version: int, options: PublishOptions
    ) -> uuid.UUID:
        if not self._is_open():
            raise ScopeClosedError("the outbox of a finished transaction cannot be used")
        self._observer.outbox_record(cast("dict[str, Any]", options))  # it may add the trace context
        publication = prepare_publication(
            content, routing_key, payload, version=version, max_body=self._max_body, **options
        )
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        if seq == 0:
            # One time and one claim per transaction: its records sort together, in write order.
            self._written_at = self._clock()
            self.claim = self._claim() if self._claim is not None else None
        record = protocol.new_record(
            record_id=uuid.uuid4().hex,
            event_id=str(publication.event_id),
            exchange=publication.exchange,
            routing_key=publication.routing_key,
            body=publication.body,
            headers=publication.headers,
            content_type=publication.content_type,
            writer=self._writer,
            written_at=self._written_at,
            seq=seq,
            claim=self.claim,
        )
        await self._collection.insert_one(record, session=self._session)
        self.records.append(record)
        if len(self.records) > 1 and self.records[-2]["seq"] > seq:  # concurrent publishes finished out of order
            self.records.sort(key=lambda r: r["seq"])
        return publication.event_id


# -- publishing records ---------------------------------------------------------------------------


class Send(Protocol):
    """Publish one outbox record's message, mandatory and confirmed; raise unless it was accepted."""

    def __call__(
        self, *, exchange: str, routing_key: str, body: bytes, headers: dict[str, Any], content_type: str | None
    ) -> Awaitable[None]: ...


class _Transport(Protocol):
    @property
    def ready(self) -> bool: ...

    @property
    def timeout(self) -> float: ...

    async def sender(self) -> Send: ...


class _ChannelTransport:
    """A confirming channel: its current underlying channel, fetched once per batch."""

    def __init__(self, channel: aio_pika.abc.AbstractChannel, timeout: float) -> None:
        self.channel = channel
        self.timeout = timeout  # for the channel while it reconnects, and for each confirm

    @property
    def ready(self) -> bool:
        return not self.channel.is_closed

    async def sender(self) -> Send:
        # A robust channel waits for its connection to come back: bounded, so a batch never
        # waits in memory while its claims run out (the records then go to a relay).
        underlay = await asyncio.wait_for(self.channel.get_underlay_channel(), self.timeout)
        send: Send = functools.partial(basic_publish, underlay, timeout=self.timeout)
        return send


class _FixedTransport:
    """An in-process send (:class:`lily_mongo.testing.TestConsumer` records what would be published)."""

    ready = True
    timeout = 0.0

    def __init__(self, send: Send) -> None:
        self._send = send

    async def sender(self) -> Send:
        return self._send


class LeftToRelay(Exception):
    """A record :func:`publish_batch` did not publish: its claim would not outlast the publish and the mark."""


async def publish_batch(
    records: Sequence[dict[str, Any]],
    transport: _Transport,
    observer: Observer,
    *,
    via: str,
    keep: Callable[[dict[str, Any]], bool] | None = None,
) -> list[BaseException | None]:
    """Publish ``records`` pipelined on ``transport``: every publish in flight at once, the confirms awaited
    together.

    The tasks start in order and each reaches the channel's publish lock without
    suspending first, so the frames go out in ``records`` order (aiormq's lock is FIFO):
    a destination queue receives them in that order. Returns, per record, None once
    confirmed or the exception that refused it (every record's, when the transport had no sender).
    ``keep``, asked once the sender is there, leaves the records it refuses unpublished
    (:class:`LeftToRelay`).
    """
    try:
        send = await transport.sender()
    except Exception as exc:
        return [exc] * len(records)
    left: dict[int, BaseException] = {}
    if keep is not None:
        left = {i: LeftToRelay() for i, record in enumerate(records) if not keep(record)}
        if left:
            chosen = [record for i, record in enumerate(records) if i not in left]
            published = iter(await _publish_all(chosen, send, observer, via=via) if chosen else [])
            return [left[i] if i in left else next(published) for i in range(len(records))]
    return await _publish_all(records, send, observer, via=via)


async def _publish_all(
    records: Sequence[dict[str, Any]], send: Send, observer: Observer, *, via: str
) -> list[BaseException | None]:

    async def one(record: dict[str, Any]) -> None:
        publish = functools.partial(
            send,
            exchange=record["exchange"],
            routing_key=record["routing_key"],
            body=bytes(record["body"]),
            content_type=record.get("content_type"),
        )
        await observer.relay_publish(lambda headers: publish(headers=headers), record, via=via)

    if len(records) == 1:  # no task needed for one
        try:
            await one(records[0])
        except Exception as exc:
            return [exc]
        return [None]
    results = await asyncio.gather(*(one(record) for record in records), return_exceptions=True)
    return [None if result is None else result for result in results]


# The dispatcher holds at most this many committed records in memory, and this many bytes of
# their bodies; past either, a transaction's records wait for a relay instead.
DISPATCH_QUEUE_LIMIT = 10_000
DISPATCH_QUEUE_BYTES = 64 * 1024 * 1024
# At most one warning per destination this often, however many of its records are refused.
UNROUTABLE_WARNING_INTERVAL = 60.0
_WARNED_DESTINATIONS = 256  # destinations remembered for rate limiting (least recently refused forgotten)
_MARK_WARNING_INTERVAL = 60.0


class OutboxCounters:
    """What one process's dispatcher and relay did, for the snapshot; the failure rule applied and logged.

    ``unroutable`` counts publishes the broker returned because nothing routes their
    destination; each such destination is logged at WARNING level at most once per
    :data:`UNROUTABLE_WARNING_INTERVAL` seconds.
    """

    def __init__(self, options: OutboxOptions) -> None:
        self._options = options
        self.pending: int | None = None
        self.failed: int | None = None
        self.published = 0
        self.unroutable = 0
        # (exchange, routing key) -> (monotonic time of its last warning, refusals since)
        self._warned: Lru[tuple[str, str], tuple[float, int]] = Lru(_WARNED_DESTINATIONS)
        self._mark_warned = -_MARK_WARNING_INTERVAL
        self._left_warned = -_MARK_WARNING_INTERVAL
        self.left = 0  # records the dispatcher left to a relay

    def confirmed(self, record: dict[str, Any]) -> None:
        self._warned.forget((str(record.get("exchange", "")), str(record.get("routing_key", ""))))

    def failure(self, record: dict[str, Any], exc: BaseException) -> Failure:
        """The failure rule for one refused publish (any failure of one record: a broker refusal, a
        record that cannot be encoded or is malformed), counted and logged."""
        options = self._options
        kind = exc.kind if isinstance(exc, PublishError) else f"failed ({type(exc).__name__})"
        failure = protocol.failed_attempt(
            record.get("attempts", 0),
            kind,
            max_attempts=options.max_attempts,
            backoff_base=options.backoff_base,
            backoff_max=options.backoff_max,
            jitter=random.random(),
        )
        if kind == "unroutable":
            self.unroutable += 1
            self._warn_unroutable(record)
        if failure.parked:
            log.warning(
                "outbox record %s (%s) parked as failed after %d attempts: publish %s; set its status back "
                "to pending once the destination accepts it",
                record.get("_id"),
                _destination(record),
                failure.attempts,
                kind,
            )
        return failure

    def marks_lost(self, count: int, what: str) -> None:
        """A mark (or failure) write failed: the records are published again after their claim expires."""
        now = time.monotonic()
        if now - self._mark_warned >= _MARK_WARNING_INTERVAL:
            self._mark_warned = now
            log.warning(
                "outbox: %s of %d record(s) failed; they are published again once their claim expires "
                "(at least once: consumers deduplicate by event id)",
                what,
                count,
                exc_info=True,
            )

    def left_to_relay(self, count: int, why: str) -> None:
        """Records the dispatcher does not publish: they stay claimed until the claim expires, then a relay
        publishes them. Logged at most once per interval."""
        self.left += count
        now = time.monotonic()
        if now - self._left_warned >= _MARK_WARNING_INTERVAL:
            self._left_warned = now
            log.warning("outbox: %d record(s) left to the relay: %s", count, why)

    def _warn_unroutable(self, record: dict[str, Any]) -> None:
        """Log a destination nothing routes, at most once per interval (it is usually a missing queue)."""
        key = (str(record.get("exchange", "")), str(record.get("routing_key", "")))
        now = time.monotonic()
        last, since = self._warned.get(key, (-UNROUTABLE_WARNING_INTERVAL, 0))
        if now - last < UNROUTABLE_WARNING_INTERVAL:
            self._warned.put(key, (last, since + 1))
            return
        self._warned.put(key, (now, 0))
        log.warning(
            "outbox: the broker returned a record for %s as unroutable: no queue receives it. Declare the "
            "destination (the consuming service's queue, or a binding) or fix the routing key; the outbox retries "
            "it with backoff and parks it as failed after %d attempts%s",
            _destination(record),
            self._options.max_attempts,
            f" ({since} more refusals since the last warning)" if since else "",
        )


def _destination(record: dict[str, Any]) -> str:
    """Where a record goes, for log lines: the routing key, and the exchange unless it is the default one."""
    exchange = str(record.get("exchange", ""))[:200]
    routing_key = str(record.get("routing_key", ""))[:200]
    if exchange:
        return f"exchange {exchange!r} routing key {routing_key!r}"
    return f"routing key {routing_key!r} (default exchange)"


async def _write_outcomes(
    majority: AsyncCollection[Any],
    counters: OutboxCounters,
    options: OutboxOptions,
    token: str,
    marks: list[str],
    failures: list[tuple[Any, Failure]],
    now: datetime.datetime,
) -> None:
    """Mark ``marks`` published (one ``update_many``) and record ``failures`` (one ``bulk_write``), both
    fenced by ``token``."""
    if marks:
        try:
            result = await majority.update_many(
                protocol.mark_filter(marks, token), protocol.mark_update(retention_seconds=options.published_retention)
            )
            counters.published += result.matched_count
        except PyMongoError:
            # Published but not marked: the claim expires and the records are published again.
            counters.marks_lost(len(marks), "marking published")
    if failures:
        writes = [
            UpdateOne(protocol.failure_filter(rid, token), protocol.failure_update(f, now)) for rid, f in failures
        ]
        try:
            await majority.bulk_write(writes, ordered=False)
        except PyMongoError:
            counters.marks_lost(len(failures), "recording failed publishes")


# -- dispatch after commit --------------------------------------------------------------------------


class OutboxDispatcher:
    """Publishes committed records from memory right after their commit; marks them in batches.

    One per process. Its claim token is on every record its writers insert while it
    runs (:meth:`claim`); a relay takes a record only once that claim expired or was
    released after a failed publish.
    """

    def __init__(
        self,
        majority: AsyncCollection[Any],
        options: OutboxOptions,
        owner: str,
        counters: OutboxCounters,
        *,
        observer: Observer = NO_OBSERVER,
        clock: Clock = utcnow,
    ) -> None:
        self._majority = majority
        self._options = options
        self._owner = owner
        self._counters = counters
        self._observer = observer
        self._clock = clock
        self.token = uuid.uuid4().hex
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._queued_bytes = 0
        self._wake = asyncio.Event()
        self._mark_wake = asyncio.Event()
        self._progress = asyncio.Event()
        self._marks: list[str] = []
        self._failures: list[tuple[Any, Failure]] = []
        self._marks_since: float | None = None
        self._publishing = False
        self._flushing = False
        self._flush_now = 0
        self._running = False
        self._tasks: list[asyncio.Task[Any]] = []

    @property
    def running(self) -> bool:
        return self._running

    @property
    def counters(self) -> OutboxCounters:
        """What it did, shared with the process's relay (the snapshot's figures)."""
        return self._counters

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
            self._counters.left_to_relay(len(records), "the dispatch queue is full (is the broker reachable?)")
            return
        self._queued_bytes += size
        committed = utcnow()
        for record in records:
            record["committed_at"] = committed  # in memory only: the relay-lag histogram starts here
        self._queue.extend(records)
        self._wake.set()

    def start(self, transport: _Transport, tasks: TaskSet) -> None:
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

    async def _publish_loop(self, transport: _Transport) -> None:
        batch_size = self._options.batch_size
        while True:
            if not self._queue:
                self._wake.clear()
                self._progress.set()
                await self._wake.wait()
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

    async def _dispatch(self, batch: list[dict[str, Any]], transport: _Transport) -> None:
        # Publish a record only if its claim outlasts the confirm and the mark: one that runs out
        # sooner (a long transaction, a wait for the broker) is the relay's, and publishing it
        # here too could publish it twice. Asked once the channel is there (docs/outbox.md).
        margin = transport.timeout + self._options.mark_interval
        clock = self._clock

        def keep(record: dict[str, Any]) -> bool:
            return protocol.claim_lasts(record, clock(), margin)

        results = await publish_batch(batch, transport, self._observer, via="dispatch", keep=keep)
        counters = self._counters
        left = 0
        for record, result in zip(batch, results, strict=True):
            if result is None:
                counters.confirmed(record)
                self._marks.append(record["_id"])
            elif isinstance(result, LeftToRelay):
                left += 1
            else:
                self._failures.append((record["_id"], counters.failure(record, result)))
        if left:
            counters.left_to_relay(left, "their claim would run out before the confirm and the mark")
        if not self._marks and not self._failures:
            return
        if self._marks_since is None:
            self._marks_since = time.monotonic()
        self._mark_wake.set()

    async def _mark_loop(self) -> None:
        options = self._options
        while True:
            if not self._marks and not self._failures:
                self._mark_wake.clear()
                self._progress.set()
                await self._mark_wake.wait()
                continue
            # Wait for a full batch, the mark interval, or a drain: one write for many records.
            since = self._marks_since if self._marks_since is not None else time.monotonic()
            while len(self._marks) < options.batch_size and not self._flush_now:
                remaining = since + options.mark_interval - time.monotonic()
                if remaining <= 0:
                    break
                self._mark_wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._mark_wake.wait(), remaining)
            marks, self._marks = self._marks[: options.batch_size], self._marks[options.batch_size :]
            failures, self._failures = self._failures, []
            self._marks_since = time.monotonic() if self._marks else None
            self._flushing = True
            try:
                await _write_outcomes(
                    self._majority, self._counters, options, self.token, marks, failures, self._clock()
                )
            finally:
                self._flushing = False
                self._progress.set()


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
        self._observer = observer
        self._options = options
        self._owner = owner
        self._clock = clock
        self.counters = counters if counters is not None else OutboxCounters(options)
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[Any] | None = None
        self._channel: aio_pika.abc.AbstractChannel | None = None
        self._claim_warned = -_MARK_WARNING_INTERVAL

    # The snapshot's figures (shared with the process's dispatcher).
    @property
    def pending(self) -> int | None:
        return self.counters.pending

    @property
    def failed(self) -> int | None:
        return self.counters.failed

    @property
    def published(self) -> int:
        return self.counters.published

    @property
    def unroutable(self) -> int:
        return self.counters.unroutable

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
        self._channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        self._task = tasks.spawn(self.run(_ChannelTransport(self._channel, confirm_timeout)), name="lily-relay")

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

    async def run(self, transport: _Transport) -> None:
        """Relay until stopped: claim a batch, publish it pipelined, mark it; poll when idle."""
        options = self._options
        next_count = 0.0
        while not self._stopping:
            if time.monotonic() >= next_count:
                await self.refresh_counts()
                next_count = time.monotonic() + options.count_interval
            batch: list[dict[str, Any]] = []
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
            try:
                await self._relay(batch, transport)
            except Exception:  # a bug, not a record's failure: the batch's claims expire to the next pass
                log.exception("outbox relay: a batch failed; its records are published again once their claim expires")

    async def drain(self, send: Send) -> int:
        """Claim and publish through ``send`` until no record is due; returns how many were published.

        For in-process transports (:class:`lily_mongo.testing.TestConsumer`): the same claim,
        publish and mark steps as :meth:`run`, without a channel.
        """
        transport = _FixedTransport(send)
        before = self.counters.published
        while batch := await self._claim_batch():
            await self._relay(batch, transport)
        await self.refresh_counts()
        return self.counters.published - before

    async def refresh_counts(self) -> None:
        """Count pending and failed records, for the snapshot: two counts, each through its partial index
        (a count of both statuses at once would not imply either index's filter, and scan the collection)."""
        try:
            pending = await self._collection.count_documents({"status": protocol.PENDING})
            failed = await self._collection.count_documents({"status": protocol.FAILED})
        except PyMongoError:
            return
        self.counters.pending, self.counters.failed = pending, failed

    async def _claim_batch(self) -> list[dict[str, Any]]:
        """Claim up to ``batch_size`` due records in three commands; returns them in publishing order."""
        size = self._options.batch_size
        found = await (
            self._collection.find(protocol.due_filter(self._clock()), {"_id": 1})
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
            protocol.claim_filter(ids, self._clock()),
            protocol.claim_update(self._owner, token, claim_seconds=self._options.claim_seconds),
        )
        if not claimed.matched_count:
            return []  # another relay took them all
        records = await self._collection.find(protocol.claimed_filter(ids, token)).batch_size(len(ids)).to_list()
        return protocol.publish_order(records)

    async def _relay(self, batch: list[dict[str, Any]], transport: _Transport) -> None:
        results = await publish_batch(batch, transport, self._observer, via="relay")
        counters = self.counters
        marks: list[str] = []
        failures: list[tuple[Any, Failure]] = []
        for record, result in zip(batch, results, strict=True):
            if result is None:
                counters.confirmed(record)
                marks.append(record["_id"])
            else:
                failures.append((record.get("_id"), counters.failure(record, result)))
        token = str(batch[0].get("claim_token"))
        await _write_outcomes(self._majority, counters, self._options, token, marks, failures, self._clock())

    def _warn_claim(self) -> None:
        now = time.monotonic()
        if now - self._claim_warned >= _MARK_WARNING_INTERVAL:
            self._claim_warned = now
            log.warning("outbox relay: claiming records failed; retrying every poll", exc_info=True)


# -- one process's outbox ---------------------------------------------------------------------------


class OutboxRuntime:
    """One process's outbox: writers for its transactions, the dispatcher after commit, the backstop relay.

    Built by a consumer's engine, by :class:`Outbox` and by :class:`~lily_mongo.Relay`.
    ``clock()`` is this process's clock corrected by its offset to the server's, read
    by :meth:`prepare` (records are inserted without ``$$NOW``).
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
        self.majority_reads = self.collection.with_options(read_concern=ReadConcern("majority"))
        self._observer = observer
        self._offset = datetime.timedelta(0)
        self.clock_read = False
        self.counters = OutboxCounters(options)
        majority = self.collection.with_options(write_concern=WriteConcern("majority"))
        self.dispatcher = OutboxDispatcher(majority, options, owner, self.counters, observer=observer, clock=self.clock)
        self.relay = OutboxRelay(
            self.collection, options, owner, observer=observer, counters=self.counters, clock=self.clock
        )
        self._dispatch_channel: aio_pika.abc.AbstractChannel | None = None
        self._relaying = False

    def clock(self) -> datetime.datetime:
        return utcnow() + self._offset

    async def prepare(self, *, indexes: bool = True) -> None:
        """Read the server's clock (``hello``'s ``localTime``) and create (or verify) the indexes."""
        await self.read_clock()
        if indexes:
            await self.relay.prepare(passive=self.options.passive_indexes)

    async def read_clock(self) -> None:
        """Read the offset of this process's clock to the server's: records carry times from :meth:`clock`,
        and a relay compares them with its own corrected clock."""
        sent = utcnow()
        hello = await self._client.admin.command("hello")
        self._offset = inbox_records.clock_offset(hello.get("localTime"), sent, utcnow())
        self.clock_read = True

    def writer(self, session: AsyncClientSession, writer: str, is_open: Callable[[], bool]) -> OutboxWriter:
        """The outbox of one transaction on ``session``; ``writer`` names it in its records (``handler``)."""
        return OutboxWriter(
            self.collection,
            session,
            writer=writer,
            max_body=self.options.max_body,
            is_open=is_open,
            observer=self._observer,
            clock=self.clock,
            claim=self.dispatcher.claim,
        )

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
        """Dispatch after commit on a confirming channel of ``connection``; relay unless ``run_relay`` is off."""
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
            self.dispatcher.start(_ChannelTransport(self._dispatch_channel, confirm_timeout), tasks)
        if self.options.run_relay if relay is None else relay:
            self._relaying = True
            await self.relay.start(connection, confirm_timeout, tasks)

    def start_in_process(self, send: Send, tasks: TaskSet) -> None:
        """Dispatch after commit through ``send`` (an in-process transport); no relay runs."""
        self.dispatcher.start(_FixedTransport(send), tasks)

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
        dispatcher = await self.dispatcher.stop(timeout)
        relay = await self.relay.stop(timeout)
        channel, self._dispatch_channel = self._dispatch_channel, None
        if channel is not None and not channel.is_closed:
            await channel.close()
        return dispatcher and relay


# -- the standalone outbox ----------------------------------------------------------------------------


class OutboxTransaction(TransactionScope, TypedPublishing):
    """What :meth:`Outbox.transaction`'s function receives: the session, the database and the outbox.

    Valid while the function runs; pass ``session=tx.session`` to every operation that
    belongs to the transaction. ``publish_json/text/binary`` and ``publish`` validate and
    return the event id exactly like a handler's ``mongo.outbox``.
    """

    __slots__ = ("_writer",)

    _closed_message = "this transaction has ended; its session and outbox cannot be used any more"

    def __init__(self, session: AsyncClientSession, database: AsyncDatabase[Any], writer: OutboxWriter) -> None:
        super().__init__(session, database)
        self._writer = writer

    def __repr__(self) -> str:
        return f"<OutboxTransaction open={self._open} written={self._writer.written}>"

    async def _publish[T](
        self, content: CustomPublishContent[T], routing_key: str, payload: T, version: int, options: PublishOptions
    ) -> uuid.UUID:
        self._check()
        return await self._writer.publish(content, routing_key, payload, version=version, **options)


class _State(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


class _Step(enum.Enum):
    COMMITTED = "committed"
    REPLAY = "replay"  # not committed: run fn again in a fresh transaction


class Outbox(OpenClose):
    """The transactional outbox for code outside handlers (a web endpoint, a script).

    ``await outbox.transaction(fn)`` runs ``fn(tx)`` in a fresh session and transaction
    and returns its result; messages staged with ``tx.publish_*`` commit with the
    business writes or not at all. Without ``amqp_url`` it only writes: nothing needs
    starting, and a relay (a consumer's, or ``lily-mongo relay``) publishes the records.
    With ``amqp_url``, ``async with Outbox(...)`` owns a connection, publishes each
    transaction's records right after its commit and runs a backstop relay unless
    ``options.run_relay`` is off (docs/outbox.md). ``mongo_client`` is the caller's.
    """

    def __init__(
        self,
        mongo_client: AsyncMongoClient[Any],
        database: str,
        *,
        amqp_url: str | None = None,
        options: OutboxOptions | None = None,
        name: str = "outbox",
        confirm_timeout: float = 10.0,
        telemetry: bool | Telemetry = True,
    ) -> None:
        if not isinstance(mongo_client, AsyncMongoClient):
            raise ConfigError(f"mongo_client must be a pymongo.AsyncMongoClient, got {describe_value(mongo_client)}")
        check_database_name("database", database)
        if amqp_url is not None:
            check_amqp_url("amqp_url", amqp_url)
        options = standalone_options(options, name)
        self._client = mongo_client
        self._database = mongo_client[database]
        self._url = amqp_url
        self._options = options
        self._name = name
        self._confirm_timeout = check_seconds("confirm_timeout", confirm_timeout, low=0, high=3600, low_inclusive=False)
        observer: Observer = resolve_telemetry(telemetry) or NO_OBSERVER
        self._runtime = OutboxRuntime(
            mongo_client, database, options, owner=f"{name[:64]}:{uuid.uuid4().hex[:12]}", observer=observer
        )
        self._tasks = TaskSet()
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._state = _State.NEW

    def __repr__(self) -> str:
        return f"<Outbox name={self._name!r} state={self._state.value} dispatch={self._url is not None}>"

    @property
    def options(self) -> OutboxOptions:
        return self._options

    @property
    def runtime(self) -> OutboxRuntime:
        """The process's outbox parts (dispatcher, relay, counters)."""
        return self._runtime

    async def open(self) -> None:
        """With ``amqp_url``: connect, read the server's clock, create the indexes, start dispatching (and
        the relay). Without: nothing to start."""
        if self._state is _State.CLOSED:
            raise LilyError("this Outbox is closed and cannot be reopened")
        if self._state is _State.OPEN:
            return
        if self._url is None:
            self._state = _State.OPEN
            return
        connection = await connect_amqp(self._url)
        try:
            try:
                await self._runtime.prepare()
            except PyMongoError as exc:
                raise mongo_error(exc, "the outbox set-up") from exc
            with channel_errors("starting the outbox"):
                await self._runtime.start(connection, self._confirm_timeout, self._tasks)
        except BaseException:
            await self._runtime.stop(1.0)
            await connection.close()
            raise
        self._connection = connection
        self._state = _State.OPEN

    async def close(self) -> None:
        """Publish and mark what was committed (within ``confirm_timeout``), stop, close the connection.

        Records not published by then stay in the collection; a relay publishes them."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        try:
            await self._runtime.stop(self._confirm_timeout)
            leftovers = self._tasks.pending()
            for task in leftovers:
                task.cancel()
            await self._tasks.join(leftovers, self._confirm_timeout)
        finally:
            if self._connection is not None:
                connection, self._connection = self._connection, None
                await connection.close()

    def _require_usable(self) -> None:
        if self._state is _State.CLOSED:
            raise LilyError("this Outbox is closed")
        if self._url is not None and self._state is not _State.OPEN:
            raise LilyError("an Outbox with amqp_url dispatches after commit: use `async with Outbox(...)` first")

    async def transaction(self, fn: Callable[[OutboxTransaction], Awaitable[T]]) -> T:
        """Run ``fn(tx)`` in a fresh session and transaction, commit, dispatch its records; return ``fn``'s result.

        ``fn`` runs again in a fresh transaction after a ``TransientTransactionError`` (by label),
        at most ``options.transaction_retries`` times, with jittered backoff. An unknown commit
        result retries the same commit (``options.commit_retries``), then reads one of the
        transaction's own records with majority read concern: present, it committed; absent
        (or no record written) raises :class:`~lily_mongo.CommitOutcomeUnknown` (``fn`` is never
        re-run to find out). Any other exception from ``fn`` aborts and propagates unchanged.
        """
        self._require_usable()
        if not self._runtime.clock_read:  # without amqp_url nothing was opened: read it on first use
            try:
                await self._runtime.read_clock()
            except PyMongoError as exc:
                raise mongo_error(exc, "reading the server's clock") from exc
        retries = self._options.transaction_retries
        replays = 0
        while True:
            step, result, writer = await self._run(fn)
            if step is _Step.COMMITTED:
                assert writer is not None
                self._runtime.committed(writer)
                return cast("T", result)
            if replays >= retries:
                raise TransportError(
                    f"the transaction did not commit after {replays + 1} runs (TransientTransactionError each "
                    f"time; OutboxOptions.transaction_retries={retries}); nothing was committed"
                )
            replays += 1
            await asyncio.sleep(
                backoff(replays, base=TRANSACTION_BACKOFF_BASE, cap=TRANSACTION_BACKOFF_MAX, jitter=random.random())
            )

    async def _run(
        self, fn: Callable[[OutboxTransaction], Awaitable[T]]
    ) -> tuple[_Step, T | None, OutboxWriter | None]:
        """One run of ``fn`` in its own session and transaction, then the commit loop."""
        session = self._client.start_session(causal_consistency=False)
        try:
            await session.start_transaction(
                read_concern=ReadConcern("snapshot"), write_concern=WriteConcern("majority")
            )
            tx: OutboxTransaction | None = None
            writer = self._runtime.writer(session, self._name, lambda: tx is not None and tx.is_open)
            tx = OutboxTransaction(session, self._database, writer)
            try:
                result = await fn(tx)
            except PyMongoError as exc:
                tx.close()
                await _abort(session)
                if inbox_records.TRANSIENT_LABEL in error_labels(exc):
                    return _Step.REPLAY, None, None
                raise
            except BaseException:
                tx.close()
                await _abort(session)
                raise
            tx.close()
            return await self._commit(session, writer), result, writer
        finally:
            await session.end_session()

    async def _commit(self, session: AsyncClientSession, writer: OutboxWriter) -> _Step:
        """Commit; on an unknown result retry the same commit, then read the transaction's record back."""
        try:
            await session.commit_transaction()
            return _Step.COMMITTED
        except PyMongoError as exc:
            if inbox_records.classify_error(error_labels(exc), in_commit=True) is inbox_records.ErrorStep.REPLAY:
                discard_server_session(session)  # not committed: run fn again
                return _Step.REPLAY
            unknown: PyMongoError = exc
        for retry in range(self._options.commit_retries):
            await asyncio.sleep(
                backoff(retry, base=TRANSACTION_BACKOFF_BASE, cap=TRANSACTION_BACKOFF_MAX, jitter=random.random())
            )
            try:
                await session.commit_transaction()
                return _Step.COMMITTED
            except PyMongoError as exc:
                unknown = exc
                step = inbox_records.classify_error(error_labels(exc), in_commit=True)
                if step is not inbox_records.ErrorStep.RETRY_COMMIT:
                    break
        discard_server_session(session)
        found = False
        if writer.records:
            try:
                found = (
                    await self._runtime.majority_reads.find_one(
                        {"_id": writer.records[0]["_id"]}, projection={"_id": 1}
                    )
                    is not None
                )
            except PyMongoError as exc:
                raise CommitOutcomeUnknown(
                    f"the commit's outcome is unknown and its outbox record could not be read back "
                    f"({type(exc).__name__}); check the data before running it again"
                ) from exc
        if protocol.read_back(written=writer.written, found=found) is protocol.ReadBack.COMMITTED:
            return _Step.COMMITTED
        what = (
            "its outbox record is not visible with majority read concern"
            if writer.records
            else "it wrote no outbox record to read back"
        )
        raise CommitOutcomeUnknown(
            f"the commit's outcome is unknown after {self._options.commit_retries} commit retries and {what}; "
            "it may or may not have committed: check the data before running it again"
        ) from unknown


async def _abort(session: AsyncClientSession) -> None:
    if session.in_transaction:
        try:
            await session.abort_transaction()
        except PyMongoError:
            discard_server_session(session)
