"""What became of published records: the counters, the failure rule applied and logged, and the fenced
writes that mark them (docs/outbox.md)."""

from __future__ import annotations

import asyncio
import datetime
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pymongo import UpdateOne
from pymongo.errors import PyMongoError

from .._amqp import AmqpFailure, amqp_failure
from .._backoff import backoff
from .._errors import PublishError
from .._lru import Lru
from .._snapshots import OutboxFigures
from . import protocol
from .options import OutboxOptions
from .protocol import Failure
from .publishing import ExchangeMissing, LeftToRelay

if TYPE_CHECKING:
    from pymongo.asynchronous.collection import AsyncCollection

log = logging.getLogger("lily_mongo")

# -- failure classes (docs/outbox.md, "Failure classes") --------------------------------------------

# What a broker's channel close says about the one publish that caused it: the record's own fault.
_REFUSALS = frozenset({AmqpFailure.NOT_FOUND, AmqpFailure.ACCESS_REFUSED, AmqpFailure.PRECONDITION_FAILED})
# A publisher's wait after a batch that failed only on transport is at most this (and backoff_max).
BREAKER_MAX = 30.0


def own_fault(exc: BaseException, *, alone: bool) -> bool:
    """Whether a failed publish was the record's own fault (it counts an attempt and can park it), not the
    transport's (it releases the record with backoff and leaves its attempts alone).

    The record's: unroutable, a message that cannot be encoded, a malformed record (a missing
    or mistyped field), an exchange a passive declare did not find, and a channel the broker
    closed for a refusal (not found, access refused, precondition failed) when that record's
    publish was the only one in flight. Everything a connection does is the transport's: a
    confirm timeout, a closed channel or connection, no channel, a nack, a blocked connection.
    """
    if isinstance(exc, ExchangeMissing):
        return True
    if isinstance(exc, PublishError):
        if exc.kind in ("unroutable", "invalid"):
            return True
        return exc.kind == "closed" and alone and amqp_failure(exc.__cause__ or exc) in _REFUSALS
    # An error no AMQP table names (a malformed record) is the record's; TimeoutError, OSError and
    # aiormq's errors are the transport's.
    return amqp_failure(exc) is None


def _kind(exc: BaseException) -> str:
    if isinstance(exc, PublishError):
        return exc.kind
    if isinstance(exc, ExchangeMissing):
        return f"refused: {exc}"
    return f"failed ({type(exc).__name__})"


class Breaker:
    """A publisher's batches that failed only on transport, in a row: the wait before its next batch and
    the delay its released records get, exponential with jitter, at most :data:`BREAKER_MAX`."""

    def __init__(self, options: OutboxOptions) -> None:
        self._base = options.backoff_base
        self._cap = min(options.backoff_max, BREAKER_MAX)
        self.streak = 0

    def delay(self, jitter: float) -> float:
        return backoff(self.streak, base=self._base, cap=self._cap, jitter=jitter)


@dataclass(slots=True)
class Settled:
    """What became of one published batch: records to mark, failures to record, records left to a relay,
    and the wait before the next batch (0 unless it failed only on transport)."""

    marks: list[str] = field(default_factory=list)
    failures: list[tuple[Any, Failure]] = field(default_factory=list)
    left: int = 0
    pause: float = 0.0


# At most one warning per destination this often, however many of its records are refused.
UNROUTABLE_WARNING_INTERVAL = (
    60.0  # the other outbox warnings (lost marks, records left to the relay), at most this often
)
_WARNED_DESTINATIONS = 256  # destinations remembered for rate limiting (least recently refused forgotten)
WARNING_INTERVAL = 60.0  # the other outbox warnings (lost marks, records left to the relay), at most this often


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
        self._mark_warned = -WARNING_INTERVAL
        self._left_warned = -WARNING_INTERVAL
        self.left = 0  # records the dispatcher left to a relay
        self.released = 0  # transport failures: records released without counting an attempt
        self.blocked_seconds = 0.0  # time publishers waited while the broker blocked their connection
        self._released_warned = -WARNING_INTERVAL

    def figures(self) -> OutboxFigures:
        """The snapshot's outbox fields."""
        return {
            "outbox_pending": self.pending,
            "outbox_failed": self.failed,
            "outbox_published": self.published,
            "outbox_unroutable": self.unroutable,
            "outbox_released": self.released,
            "outbox_blocked_seconds": self.blocked_seconds,
        }

    def confirmed(self, record: dict[str, Any]) -> None:
        self._warned.forget((str(record.get("exchange", "")), str(record.get("routing_key", ""))))

    def settle(
        self, batch: Sequence[dict[str, Any]], results: Sequence[BaseException | None], breaker: Breaker
    ) -> Settled:
        """Apply the failure classes to one published batch; the breaker learns whether it failed only on
        transport. One jitter for the batch: records that fail together get one ``available_at``."""
        settled = Settled()
        jitter = random.random()
        tried = sum(1 for result in results if not isinstance(result, (LeftToRelay, ExchangeMissing)))
        release_delay = breaker.delay(jitter)
        transport = 0
        for record, result in zip(batch, results, strict=True):
            if result is None:
                self.confirmed(record)
                settled.marks.append(record["_id"])
            elif isinstance(result, LeftToRelay):
                settled.left += 1
            else:
                failure = self.failure(record, result, jitter=jitter, alone=tried == 1, release_delay=release_delay)
                transport += not failure.counted
                settled.failures.append((record.get("_id"), failure))
        if transport and transport == len(settled.failures) and not settled.marks:
            settled.pause = release_delay
            breaker.streak += 1
        elif settled.marks or settled.failures:
            breaker.streak = 0
        if transport:
            self._warn_released(transport, settled.failures)
        return settled

    def failure(
        self, record: dict[str, Any], exc: BaseException, *, jitter: float, alone: bool, release_delay: float
    ) -> Failure:
        """The failure rule for one refused publish, by its class: the record's own fault counts an
        attempt (parked at ``max_attempts``); a transport failure releases it after ``release_delay``."""
        options = self._options
        kind = _kind(exc)
        if not own_fault(exc, alone=alone):
            self.released += 1
            return protocol.released(record.get("attempts", 0), kind, delay=release_delay)
        failure = protocol.failed_attempt(
            record.get("attempts", 0),
            kind,
            max_attempts=options.max_attempts,
            backoff_base=options.backoff_base,
            backoff_max=options.backoff_max,
            jitter=jitter,
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

    def _warn_released(self, count: int, failures: list[tuple[Any, Failure]]) -> None:
        now = time.monotonic()
        if now - self._released_warned >= WARNING_INTERVAL:
            self._released_warned = now
            cause = next(f.last_error for _, f in failures if not f.counted)
            log.warning(
                "outbox: %d record(s) released after a transport failure (%s); they are retried with backoff, "
                "their attempts not counted",
                count,
                cause,
            )

    def marks_lost(self, count: int, what: str) -> None:
        """A mark (or failure) write failed: the records are published again after their claim expires."""
        now = time.monotonic()
        if now - self._mark_warned >= WARNING_INTERVAL:
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
        if now - self._left_warned >= WARNING_INTERVAL:
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


# Mark writes in flight at once, and the tries of each (a mark is idempotent: fenced by token and status).
MARK_WRITES_IN_FLIGHT = 4
MARK_TRIES = 3
MARK_RETRY_DELAY = 0.05


async def write_outcomes(
    majority: AsyncCollection[Any],
    counters: OutboxCounters,
    options: OutboxOptions,
    token: str,
    marks: list[str],
    failures: list[tuple[Any, Failure]],
    now: datetime.datetime,
) -> None:
    """Mark ``marks`` published (one ``update_many`` per ``batch_size`` of them, at most
    :data:`MARK_WRITES_IN_FLIGHT` at once) and record ``failures`` (one ``bulk_write``), all fenced by
    ``token``; a write that fails is tried again, :data:`MARK_TRIES` times in all."""
    size = options.batch_size
    gate = asyncio.Semaphore(MARK_WRITES_IN_FLIGHT)

    async def mark(chunk: list[str]) -> None:
        async with gate:
            try:
                result = await _tried(
                    lambda: majority.update_many(
                        protocol.mark_filter(chunk, token),
                        protocol.mark_update(retention_seconds=options.published_retention),
                    )
                )
                counters.published += result.matched_count
                if counters.pending is not None:  # the count between two refreshes agrees with the marks
                    counters.pending = max(0, counters.pending - result.matched_count)
            except PyMongoError:
                # Published but not marked: the claim expires and the records are published again.
                counters.marks_lost(len(chunk), "marking published")

    async def record_failures() -> None:
        writes = [
            UpdateOne(protocol.failure_filter(rid, token), protocol.failure_update(f, now)) for rid, f in failures
        ]
        async with gate:
            try:
                await _tried(lambda: majority.bulk_write(writes, ordered=False))
            except PyMongoError:
                counters.marks_lost(len(failures), "recording failed publishes")

    writes = [mark(marks[i : i + size]) for i in range(0, len(marks), size)]
    if failures:
        writes.append(record_failures())
    if len(writes) == 1:
        await writes[0]
    elif writes:
        await asyncio.gather(*writes)


async def _tried[T](write: Callable[[], Awaitable[T]]) -> T:
    for attempt in range(MARK_TRIES - 1):
        try:
            return await write()
        except PyMongoError:
            await asyncio.sleep(MARK_RETRY_DELAY * 2**attempt)
    return await write()
