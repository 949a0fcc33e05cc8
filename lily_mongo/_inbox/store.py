"""The record collection as the inbox writes it outside transactions: the lease claim, renewals, releases
and counts, each majority-acknowledged and bounded by a ``maxTimeMS`` (docs/inbox.md, "Majority, always",
"Bounded waits", "Counting deferrals"); and what the inbox reads from the server at start (its clock, its
transaction lifetime, the TTL index).

Every decision is a pure function of :mod:`.protocol` (called through the module, so the protocol model can
replace one); this module performs them.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pymongo
from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError, PyMongoError
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from .._errors import ErrorCode
from .._mongo import (
    DEFAULT_TRANSACTION_LIFETIME,
    ensure_index,
    server_clock_offset,
    transaction_lifetime,
    wait_expired,
    write_unconfirmed,
)
from .._mongo import transactions as transaction
from .._mongo.rules import Rules
from .._mongo.transactions import majority_reads
from .._verdicts import Outcome, PipelineResult
from . import protocol
from .lease import Lease, in_time
from .options import InboxOptions

if TYPE_CHECKING:
    from pymongo import AsyncMongoClient
    from pymongo.asynchronous.client_session import AsyncClientSession

__all__ = ["RecordStore"]

log = logging.getLogger("lily_mongo")


class RecordStore:
    """The inbox's record collection and the server facts it depends on; one per inbox."""

    def __init__(
        self,
        client: AsyncMongoClient[Any],
        database: str,
        options: InboxOptions,
        *,
        deadlines: Mapping[str, float] | None = None,
    ) -> None:
        """``deadlines``: each queue's delivery deadline (seconds), which bounds the waits of its
        deliveries and is compared with the server's transaction lifetime at start."""
        self.client = client
        self.database = client[database]
        self.options = options
        # Inside a transaction the transaction's read and write concerns apply.
        self.records = self.database[options.records]
        # Outside one, every write is majority-acknowledged and every read majority-committed,
        # whatever the client's defaults: a w:1 write can be rolled back, and a claim that read
        # a completion a failover then undoes would ACK an event that never committed
        # (docs/inbox.md, "Majority, always").
        self._outside = self.records.with_options(
            write_concern=WriteConcern("majority"), read_concern=ReadConcern("majority")
        )
        # The read that decides an unknown commit: majority read concern, from the primary.
        self.read_backs = majority_reads(self.records)
        self.deadlines = dict(deadlines or {})
        self.lifetime = options.transaction_lifetime_seconds or DEFAULT_TRANSACTION_LIFETIME
        self.clock_offset = datetime.timedelta(0)  # server clock - consumer clock, read by prepare()
        # How often an attempt's transaction is replayed and its commit retried (docs/inbox.md).
        self.rules = Rules(
            replay_budget=options.replay_budget,
            commit_retries=options.commit_retries,
            backoff_base=options.backoff_base,
            backoff_max=options.backoff_max,
        )

    def now(self) -> datetime.datetime:
        """The server's time: the consumer's clock corrected by the offset read at start."""
        return datetime.datetime.now(datetime.UTC) + self.clock_offset

    def wait_for(self, queue: str) -> float:
        """How long a write of a ``queue`` delivery's record outside a transaction may wait (its
        ``maxTimeMS``): ``max_wait_seconds``, at most a quarter of the queue's delivery deadline."""
        deadline = self.deadlines.get(queue)
        wait = self.options.max_wait_seconds
        return wait if deadline is None else min(wait, deadline / 4)

    # -- set-up -------------------------------------------------------------------------------------

    async def prepare(self) -> None:
        """Create the record collection's TTL index (idempotent), or only verify it in passive mode.

        Also reads the server's clock (``hello``'s ``localTime``): a first-time copy's
        record is written with ``$setOnInsert``, which takes no ``$$NOW``, so its
        retention is counted from the consumer's clock corrected by this offset.
        """
        self.clock_offset = await server_clock_offset(self.client)
        await self._read_lifetime()
        await ensure_index(
            self._outside,
            "lily_purge_at_ttl",
            [("purge_at", 1)],
            passive=self.options.passive_indexes,
            expireAfterSeconds=0,
        )

    async def _read_lifetime(self) -> None:
        """Read the server's transaction lifetime; warn about queues whose deadline exceeds it.

        A deadline longer than the lifetime lets an attempt run until the server aborts its
        transaction for its age; the inbox then gives it one more try and dead-letters it
        with ``QUEUE_TRANSACTION_EXPIRED`` (docs/inbox.md, "The transaction lifetime"). That
        is a warning, not a refusal to start: the limit is a server parameter an operator
        may change while consumers run, and where the server does not say it is a guess.
        """
        lifetime = self.options.transaction_lifetime_seconds
        read = "InboxOptions.transaction_lifetime_seconds"
        if lifetime is None:
            lifetime = await transaction_lifetime(self.client)
            read = "the server's transactionLifetimeLimitSeconds"
            if lifetime is None:
                lifetime = DEFAULT_TRANSACTION_LIFETIME
                read = "MongoDB's default transaction lifetime (the server did not answer getParameter)"
                # A plain fact, at DEBUG: a server that does not answer getParameter (an emulator, a
                # restricted user) almost always runs with MongoDB's default (docs/inbox.md).
                log.debug(
                    "the server did not answer getParameter (getParameter refused): the inbox assumes MongoDB's "
                    "default transactionLifetimeLimitSeconds, %g s (InboxOptions.transaction_lifetime_seconds "
                    "gives another)",
                    lifetime,
                )
        self.lifetime = lifetime
        for queue, deadline in sorted(self.deadlines.items()):
            if deadline > lifetime:
                log.warning(
                    "queue %s: its delivery deadline (%g s) exceeds %s (%g s): an attempt that runs longer is "
                    "aborted by the server, tried once more, then dead-lettered with %s",
                    queue,
                    deadline,
                    read,
                    lifetime,
                    ErrorCode.TRANSACTION_EXPIRED.value,
                )

    # -- the lease, outside transactions --------------------------------------------------------------

    async def claim(self, key: str, handler_id: str, event_id: str, owner: str, wait: float) -> protocol.Claim:
        """The lease claim: one atomic upsert on the server clock, read as the protocol reads it."""
        pipeline = protocol.claim_pipeline(
            handler_id,
            event_id,
            owner,
            lease_seconds=self.options.lease_seconds,
            stale_seconds=self.options.stale_lease_seconds,
        )
        with pymongo.timeout(wait):
            for _ in range(3):
                try:
                    record: dict[str, Any] | None = await self._outside.find_one_and_update(
                        {"_id": key}, pipeline, upsert=True, return_document=ReturnDocument.AFTER
                    )
                except DuplicateKeyError:
                    continue  # two concurrent upserts of a new key: the loser retries as an update
                assert record is not None
                return protocol.read_claim(record, owner)
        raise DuplicateKeyError("the inbox claim kept colliding on upsert")  # pragma: no cover - the caller defers

    async def abort(self, session: AsyncClientSession) -> None:
        """Abort ``session``'s transaction, within the bounded wait, whatever the server answers."""
        await transaction.abort_quietly(session, self.options.max_wait_seconds)

    @staticmethod
    def claim_failed(exc: PyMongoError, wait: float) -> PipelineResult:
        """The deferral a failed claim becomes: it never ran the handler."""
        if wait_expired(exc):
            reason = f"the claim waited {wait:g} s (its maxTimeMS) for a transaction that holds the record"
            return PipelineResult(Outcome.DEFERRED, ErrorCode.LEASE_BUSY, reason)
        if write_unconfirmed(exc):
            reason = f"the claim was not majority-acknowledged: {type(exc).__name__}"
            return PipelineResult(Outcome.DEFERRED, ErrorCode.MONGO_UNAVAILABLE, reason)
        return PipelineResult(Outcome.DEFERRED, ErrorCode.MONGO_UNAVAILABLE, f"inbox unavailable: {type(exc).__name__}")

    async def renew(self, lease: Lease) -> bool | None:
        """One fenced renewal of ``lease``: True renewed, False taken over, None when the write failed
        (the caller bounds it)."""
        options = self.options
        try:
            result = await self._outside.update_one(
                protocol.fence(lease.key, lease.owner, lease.token),
                protocol.renewal_update(lease_seconds=options.lease_seconds, stale_seconds=options.stale_lease_seconds),
            )
        except PyMongoError:
            return None
        return result.matched_count > 0

    async def release(self, lease: Lease, outcome: Outcome | None) -> int | None:
        """Fenced release: delete on a final verdict; on a deferral expire it and return the deferral count.

        ``outcome`` None: cancelled from outside; the record is deleted unless it counts
        deferrals or expired transactions, which a plain release keeps. A cancelled attempt
        whose transaction had outlived the lifetime is counted as such first.
        """
        fence = protocol.fence(lease.key, lease.owner, lease.token)
        if outcome is None:
            await self.count_if_outlived(lease)
        # A verdict is settled before the delivery's deadline: its release must end in time
        # (docs/inbox.md, "Bounded waits"). Cancelled from outside, the deadline is past.
        bound = lease.wait if outcome is None else in_time(lease)
        with pymongo.timeout(bound):
            if outcome is None:
                deleted = await self._outside.delete_one(
                    protocol.cancelled_release_filter(lease.key, lease.owner, lease.token)
                )
                if deleted.deleted_count == 0:
                    await self._outside.update_one(fence, protocol.released_update())
                return None
            if outcome is not Outcome.DEFERRED:
                await self._outside.delete_one(fence)
                return None
            record = await self._outside.find_one_and_update(
                fence, protocol.deferral_release_update(), return_document=ReturnDocument.AFTER
            )
        if record is None:  # lost (or committed) meanwhile: count this deferral on whatever is there
            return await self.count(lease, protocol.DEFERRALS, bound=in_time(lease))
        return protocol.read_count(record, protocol.DEFERRALS)

    async def count(self, lease: Lease, counter: str, *, bound: float | None = None) -> int | None:
        """Count one more ``counter`` in the event's record (created if absent); None when that fails."""
        update = protocol.count_update(
            counter, lease.handler_id, lease.event_id, stale_seconds=self.options.stale_lease_seconds
        )
        try:
            with pymongo.timeout(lease.wait if bound is None else bound):
                for _ in range(3):
                    try:
                        record = await self._outside.find_one_and_update(
                            {"_id": lease.key},
                            update,
                            upsert=True,
                            projection={counter: 1},
                            return_document=ReturnDocument.AFTER,
                        )
                    except DuplicateKeyError:
                        continue  # two concurrent upserts of a new key: the loser retries as an update
                    return protocol.read_count(record, counter)
        except PyMongoError:
            log.debug("counting %s in the inbox record failed", counter, exc_info=True)
        return None

    async def count_if_outlived(self, lease: Lease) -> None:
        """An attempt cancelled from outside while its transaction was older than the lifetime
        (the server has aborted it, or will): it counts as one that outlived it."""
        age = lease.cancelled_age
        if age is not None and protocol.outlived(age, self.lifetime):
            await asyncio.shield(self.count(lease, protocol.EXPIRATIONS))
