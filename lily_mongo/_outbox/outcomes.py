"""What became of published records: the counters, the failure rule applied and logged, and the fenced
writes that mark them (docs/outbox.md)."""

from __future__ import annotations

import datetime
import logging
import random
import time
from typing import TYPE_CHECKING, Any

from pymongo import UpdateOne
from pymongo.errors import PyMongoError

from .._errors import PublishError
from .._lru import Lru
from . import protocol
from .options import OutboxOptions
from .protocol import Failure

if TYPE_CHECKING:
    from pymongo.asynchronous.collection import AsyncCollection

log = logging.getLogger("lily_mongo")

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


async def write_outcomes(
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
            if counters.pending is not None:  # the count between two refreshes agrees with the marks
                counters.pending = max(0, counters.pending - result.matched_count)
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
