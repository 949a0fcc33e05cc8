"""The MongoDB lease inbox: fast path, lease, transaction, replay, reconciliation (SPEC section 5).

For one delivery of handler ``H`` and event ``E`` (key ``H|E``):

1. Fast path: a completion record for the key exists → duplicate → ACK.
2. Acquire the lease document with one atomic ``find_one_and_update(upsert=True)``
   whose expiry test and new expiry use the server clock (``$$NOW``). Held by a
   live owner → deferred (the deferral counter is incremented in the same update).
3. A heartbeat renews the lease, fenced by owner and token; a lost lease
   cancels the attempt → deferred.
4. Each attempt opens a fresh scope: new session, new transaction, new
   middleware/handler call. The handler's writes, its outbox records and the
   unique completion record commit together.
5. ``TransientTransactionError`` (by label) anywhere, or a commit that fails
   without ``UnknownTransactionCommitResult``, aborts and replays the whole
   attempt with jittered backoff, bounded by the replay budget → else deferred.
6. ``UnknownTransactionCommitResult`` → retry the same commit (bounded); still
   unknown → read the completion record with majority read concern: ours →
   committed; another owner's → duplicate; absent → deferred. The handler is
   never re-run to find out. (Two loops: replay the pipeline, retry the commit.)
7. After commit: release the lease (fenced), then the runtime ACKs.
8. Failures abort, release the lease, then the runtime hands off.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError, OperationFailure, PyMongoError
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from .bounds import BOUNDS
from .errors import ConfigError, ScopeClosedError
from .extractors import NOT_DECODED
from .outbox import Outbox, OutboxRelay, RelayOptions, utcnow
from .settlement import Outcome, PipelineResult

if TYPE_CHECKING:
    import aio_pika.abc
    from pymongo import AsyncMongoClient
    from pymongo.asynchronous.client_session import AsyncClientSession
    from pymongo.asynchronous.database import AsyncDatabase

    from .extractors import RawDelivery
    from .plan import HandlerRoute
    from .runtime import Execution, QueueRuntime, Runtime, TaskSet

__all__ = ["Inbox", "InboxOptions", "MongoScope"]

log = logging.getLogger("lily_mongo")

TRANSIENT = "TransientTransactionError"
UNKNOWN_COMMIT = "UnknownTransactionCommitResult"


@dataclass(frozen=True, slots=True, kw_only=True)
class InboxOptions:
    """Collections, lease timing, retention and replay budgets of the inbox and outbox."""

    completions: str = "lily_inbox"
    leases: str = "lily_leases"
    outbox: str = "lily_outbox"
    lease_seconds: float = 30.0
    heartbeat_seconds: float | None = None  # default: lease_seconds / 3
    retention_seconds: float = 7 * 24 * 3600.0
    stale_lease_seconds: float = 24 * 3600.0
    replay_budget: int = 5
    commit_retries: int = 3
    backoff_base: float = 0.02
    backoff_max: float = 1.0
    outbox_max_body: int = BOUNDS.outbox_body_default
    passive_indexes: bool = False
    relay: RelayOptions = field(default_factory=RelayOptions)
    run_relay: bool = True

    def __post_init__(self) -> None:
        for name in ("completions", "leases", "outbox"):
            value = getattr(self, name)
            if not isinstance(value, str) or not 0 < len(value.encode()) <= 120 or "$" in value:
                raise ConfigError(f"InboxOptions.{name} must be a collection name of 1..120 bytes, got {value!r:.60}")
        if not 0.05 <= self.lease_seconds <= 3600:
            raise ConfigError(f"InboxOptions.lease_seconds must be 0.05..3600, got {self.lease_seconds!r}")
        heartbeat = self.heartbeat_seconds if self.heartbeat_seconds is not None else self.lease_seconds / 3
        if not 0 < heartbeat < self.lease_seconds:
            raise ConfigError(f"InboxOptions.heartbeat_seconds must be > 0 and < lease_seconds, got {heartbeat!r}")
        object.__setattr__(self, "heartbeat_seconds", heartbeat)
        if not 60 <= self.retention_seconds <= 366 * 24 * 3600:
            raise ConfigError(f"InboxOptions.retention_seconds must be 60..31622400, got {self.retention_seconds!r}")
        if not 0 <= self.replay_budget <= 100:
            raise ConfigError(f"InboxOptions.replay_budget must be 0..100, got {self.replay_budget!r}")
        if not 0 <= self.commit_retries <= 100:
            raise ConfigError(f"InboxOptions.commit_retries must be 0..100, got {self.commit_retries!r}")
        if not 1 <= self.outbox_max_body <= BOUNDS.outbox_body_max:
            raise ConfigError(
                f"InboxOptions.outbox_max_body must be 1..{BOUNDS.outbox_body_max} bytes, got {self.outbox_max_body!r}"
            )


class MongoScope:
    """The handler's view of one attempt: its session, the database and the outbox.

    Valid for one attempt only; any use after the attempt ended raises
    :class:`ScopeClosedError`. Pass ``session=mongo.session`` to every operation
    that belongs to the transaction.
    """

    __slots__ = ("_database", "_open", "_outbox", "_session")

    def __init__(self, session: AsyncClientSession, database: AsyncDatabase[Any], outbox: Outbox | None) -> None:
        self._session = session
        self._database = database
        self._outbox = outbox
        self._open = True

    def __repr__(self) -> str:
        return f"<MongoScope open={self._open}>"

    def _check(self) -> None:
        if not self._open:
            raise ScopeClosedError("this MongoScope belongs to a finished attempt; it cannot be used any more")

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def session(self) -> AsyncClientSession:
        """The attempt's session, in a transaction."""
        self._check()
        return self._session

    @property
    def database(self) -> AsyncDatabase[Any]:
        """The consumer's database."""
        self._check()
        return self._database

    @property
    def outbox(self) -> Outbox:
        """Messages staged here are published by the relay after the commit."""
        self._check()
        assert self._outbox is not None
        return self._outbox

    def close(self) -> None:
        self._open = False


class _ReplayNeeded(Exception):
    """The attempt must be replayed in a fresh scope (transient error, or commit not applied)."""


@dataclass(slots=True)
class _Lease:
    key: str
    owner: str
    token: int
    lost: asyncio.Event
    held: bool = True
    committing: bool = False


def _discard_server_session(session: AsyncClientSession) -> None:
    """Never reuse a session whose transaction outcome is unclear.

    MongoDB aborts a session's open transaction when the next transaction on
    that session starts; some emulators instead keep it open and commit it with
    the next one. Marking the server session dirty makes PyMongo drop it from
    its pool, which is harmless on MongoDB (the server times it out).
    """
    server_session = getattr(session, "_server_session", None)
    mark_dirty = getattr(server_session, "mark_dirty", None)
    if callable(mark_dirty):
        mark_dirty()


class Inbox:
    """Runs inbox handlers under the lease protocol and owns the outbox relay."""

    def __init__(
        self,
        client: AsyncMongoClient[Any],
        database: str,
        options: InboxOptions,
        *,
        owner_prefix: str,
        tasks: TaskSet,
        uses_inbox: bool,
    ) -> None:
        self.client = client
        self.database = client[database]
        self.options = options
        self.completions = self.database[options.completions]
        self.leases = self.database[options.leases]
        self.outbox = self.database[options.outbox]
        self.owner_prefix = owner_prefix[:64]
        self.instance = uuid.uuid4().hex[:12]
        self.tasks = tasks
        self.uses_inbox = uses_inbox
        self.relay = OutboxRelay(self.outbox, options.relay, f"{self.owner_prefix}:{self.instance}")
        self._relay_task: asyncio.Task[Any] | None = None
        self._relay_channel: aio_pika.abc.AbstractChannel | None = None

    # -- setup --------------------------------------------------------------------------

    _INDEXES: tuple[tuple[str, str, list[tuple[str, int]], dict[str, Any]], ...] = (
        ("completions", "lily_expires_at_ttl", [("expires_at", 1)], {"expireAfterSeconds": 0}),
        ("leases", "lily_stale_at_ttl", [("stale_at", 1)], {"expireAfterSeconds": 0}),
        ("outbox", "lily_status_available", [("status", 1), ("available_at", 1)], {}),
        ("outbox", "lily_expires_at_ttl", [("expires_at", 1)], {"expireAfterSeconds": 0}),
    )

    async def prepare(self) -> None:
        """Create the TTL and relay indexes (idempotent), or only verify them in passive mode."""
        for attr, name, keys, extra in self._INDEXES:
            collection = getattr(self, attr)
            if self.options.passive_indexes:
                existing = await collection.index_information()
                if name not in existing:
                    raise ConfigError(f"index {name!r} is missing on collection {collection.name!r} (passive mode)")
                continue
            try:
                await collection.create_index(keys, name=name, **extra)
            except OperationFailure as exc:
                raise ConfigError(
                    f"index {name!r} on {collection.name!r} exists with other options: {exc.details}"
                ) from exc

    async def start_relay(self, connection: aio_pika.abc.AbstractConnection, confirm_timeout: float) -> None:
        if not self.options.run_relay:
            return
        self._relay_channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        self._relay_task = self.tasks.spawn(self.relay.run(self._relay_channel, confirm_timeout), name="lily-relay")

    async def stop_relay(self, timeout: float) -> bool:
        """Stop after the in-flight publish settles or ``timeout`` ends; True if the relay ended."""
        self.relay.stop()
        task = self._relay_task
        ended = True
        if task is not None:
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if not done:
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=timeout)
            ended = bool(done)
        if self._relay_channel is not None and not self._relay_channel.is_closed:
            await self._relay_channel.close()
        return ended

    def outbox_counts(self) -> tuple[int | None, int | None, int]:
        return self.relay.pending, self.relay.failed, self.relay.published

    # -- the lease protocol -------------------------------------------------------------

    def reraise_transaction_error(self, exc: BaseException) -> None:
        """Let labelled database errors escape the handler's verdict to the replay loop."""
        if isinstance(exc, PyMongoError) and exc.has_error_label(TRANSIENT):
            raise exc

    async def execute(
        self, runtime: Runtime, qr: QueueRuntime, route: HandlerRoute, delivery: RawDelivery, payload: Any
    ) -> Execution:
        """Run one delivery under the lease protocol; ``payload`` is the already decoded body."""
        from .runtime import Execution

        key = f"{route.handler_id}|{delivery.envelope.event_id}"
        owner = f"{self.owner_prefix}:{self.instance}:{uuid.uuid4().hex[:12]}"
        try:
            if await self.completions.find_one({"_id": key}, projection={"_id": 1}) is not None:
                return Execution(PipelineResult(Outcome.DUPLICATE))
            lease_doc = await self._acquire(key, owner)
        except PyMongoError as exc:
            # The database is unreachable or refused: infrastructure, not an application
            # failure. Requeue (bounded) without running the handler.
            reason = f"inbox unavailable: {type(exc).__name__}"
            return Execution(PipelineResult(Outcome.DEFERRED, "MONGO_UNAVAILABLE", reason))
        if lease_doc.get("owner") != owner:
            remaining = self._remaining(lease_doc)
            return Execution(
                PipelineResult(Outcome.DEFERRED, "LEASE_HELD", "the lease is held by another live owner"),
                deferrals=int(lease_doc.get("deferrals", 0)),
                backoff_limit=remaining,
            )
        lease = _Lease(key, owner, int(lease_doc["token"]), asyncio.Event())
        heartbeat = self.tasks.spawn(self._heartbeat(lease), name="lily-heartbeat")
        execution: Execution | None = None
        try:
            execution = await self._attempts(runtime, qr, route, delivery, lease, payload)
        finally:
            heartbeat.cancel()
            # Release or mark the lease even if this task is being cancelled. Cancelled
            # from outside (deadline, forced shutdown), the attempt is not a deferral:
            # the runtime settles it otherwise, so the lease is simply released.
            deferred = execution is not None and execution.result.outcome is Outcome.DEFERRED
            release = asyncio.ensure_future(self._finish_lease(lease, deferred=deferred))
            try:
                deferrals = await asyncio.shield(release)
            except PyMongoError:
                log.warning("lease release failed; it will expire", exc_info=True)
                deferrals = 0
            if execution is not None and deferred:
                execution.deferrals = deferrals
        return execution

    def _remaining(self, lease_doc: dict[str, Any]) -> float:
        expires = lease_doc.get("expires_at")
        if not isinstance(expires, datetime.datetime):
            return self.options.lease_seconds
        if expires.tzinfo is None:
            expires = expires.replace(tzinfo=datetime.UTC)
        return max((expires - utcnow()).total_seconds(), 0.0)

    async def _acquire(self, key: str, owner: str) -> dict[str, Any]:
        lease_ms = int(self.options.lease_seconds * 1000)
        stale_ms = int(self.options.stale_lease_seconds * 1000)
        free = {
            "$or": [
                {"$eq": [{"$ifNull": ["$owner", None]}, None]},
                {"$lte": [{"$ifNull": ["$expires_at", None]}, "$$NOW"]},
            ]
        }
        pipeline: list[dict[str, Any]] = [
            {"$set": {"_lily_free": free}},
            {
                "$set": {
                    "owner": {"$cond": ["$_lily_free", owner, "$owner"]},
                    "token": {"$cond": ["$_lily_free", {"$add": [{"$ifNull": ["$token", 0]}, 1]}, "$token"]},
                    "expires_at": {"$cond": ["$_lily_free", {"$add": ["$$NOW", lease_ms]}, "$expires_at"]},
                    "stale_at": {"$add": ["$$NOW", lease_ms + stale_ms]},
                    "acquisitions": {"$add": [{"$ifNull": ["$acquisitions", 0]}, {"$cond": ["$_lily_free", 1, 0]}]},
                    "deferrals": {"$add": [{"$ifNull": ["$deferrals", 0]}, {"$cond": ["$_lily_free", 0, 1]}]},
                }
            },
            {"$unset": "_lily_free"},
        ]
        for _ in range(3):
            try:
                doc: dict[str, Any] | None = await self.leases.find_one_and_update(
                    {"_id": key}, pipeline, upsert=True, return_document=ReturnDocument.AFTER
                )
            except DuplicateKeyError:
                continue  # two concurrent upserts of a new key: the loser retries as an update
            assert doc is not None
            return doc
        raise ConfigError("lease acquisition kept colliding on upsert")  # pragma: no cover

    async def _heartbeat(self, lease: _Lease) -> None:
        interval = self.options.heartbeat_seconds or self.options.lease_seconds / 3
        lease_ms = int(self.options.lease_seconds * 1000)
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            try:
                result = await self.leases.update_one(
                    {"_id": lease.key, "owner": lease.owner, "token": lease.token},
                    [{"$set": {"expires_at": {"$add": ["$$NOW", lease_ms]}}}],
                )
            except PyMongoError:
                if time.monotonic() - last_ok > self.options.lease_seconds:
                    lease.lost.set()
                    return
                continue
            if result.matched_count == 0:
                lease.lost.set()
                return
            last_ok = time.monotonic()

    async def _finish_lease(self, lease: _Lease, *, deferred: bool) -> int:
        """Fenced release: delete on a final verdict, keep (expired, deferrals + 1) on deferral."""
        fence = {"_id": lease.key, "owner": lease.owner, "token": lease.token}
        if deferred:
            doc = await self.leases.find_one_and_update(
                fence,
                [
                    {
                        "$set": {
                            "owner": None,
                            "expires_at": "$$NOW",
                            "deferrals": {"$add": [{"$ifNull": ["$deferrals", 0]}, 1]},
                        }
                    }
                ],
                return_document=ReturnDocument.AFTER,
            )
            if doc is None:  # lost meanwhile: count the deferral on whatever is there
                doc = await self.leases.find_one({"_id": lease.key}) or {}
            return int(doc.get("deferrals", 0))
        await self.leases.delete_one(fence)
        return 0

    async def _attempts(
        self,
        runtime: Runtime,
        qr: QueueRuntime,
        route: HandlerRoute,
        delivery: RawDelivery,
        lease: _Lease,
        payload: Any,
    ) -> Execution:
        """The replay loop: each pass is a fresh scope; transient failures replay the whole pipeline."""
        from .runtime import Execution

        execution = Execution(PipelineResult(Outcome.DEFERRED, "REPLAY_BUDGET_SPENT", ""))
        attempt = 0
        while True:
            attempt += 1
            execution.attempts = attempt
            # The first attempt reuses the body decoded while preparing; a replay decodes
            # afresh so a handler that mutated its payload cannot leak into the replay.
            first = payload if attempt == 1 else NOT_DECODED
            task = asyncio.ensure_future(self._attempt(runtime, qr, route, delivery, lease, attempt, execution, first))
            lost = asyncio.ensure_future(lease.lost.wait())
            try:
                await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                task.cancel()
                lost.cancel()
                await asyncio.wait({task})
                raise
            lost.cancel()
            if not task.done():
                if lease.committing:
                    await asyncio.wait({task})  # never cut a commit short: reconcile it instead
                else:
                    task.cancel()
                    await asyncio.wait({task})
                    execution.result = PipelineResult(
                        Outcome.DEFERRED, "LEASE_LOST", "the lease was lost while the handler ran"
                    )
                    return execution
            try:
                execution.result = task.result()
                return execution
            except asyncio.CancelledError:
                execution.result = PipelineResult(Outcome.DEFERRED, "LEASE_LOST", "attempt cancelled")
                return execution
            except _ReplayNeeded as replay:
                execution.transient_replays += 1
                if execution.transient_replays > self.options.replay_budget:
                    execution.result = PipelineResult(
                        Outcome.DEFERRED,
                        "REPLAY_BUDGET_SPENT",
                        f"{execution.transient_replays - 1} transient replays (budget "
                        f"{self.options.replay_budget}); last: {replay}",
                    )
                    return execution
                cap = min(self.options.backoff_max, self.options.backoff_base * 2**execution.transient_replays)
                await asyncio.sleep(random.uniform(0, cap))

    async def _attempt(
        self,
        runtime: Runtime,
        qr: QueueRuntime,
        route: HandlerRoute,
        delivery: RawDelivery,
        lease: _Lease,
        attempt: int,
        execution: Execution,
        payload: Any,
    ) -> PipelineResult:
        session = self.client.start_session(causal_consistency=False)
        scope: MongoScope | None = None
        try:
            await session.start_transaction(
                read_concern=ReadConcern("snapshot"), write_concern=WriteConcern("majority")
            )
            outbox = Outbox(
                self.outbox,
                session,
                handler_id=route.handler_id,
                max_body=self.options.outbox_max_body,
                is_open=lambda: scope is not None and scope.is_open,
            )
            scope = MongoScope(session, self.database, outbox)
            try:
                result = await runtime.run_attempt(qr, route, delivery, attempt=attempt, scope=scope, payload=payload)
                if result.outcome is not Outcome.SUCCESS:
                    await self._abort(session)
                    return result
                now = utcnow()
                await self.completions.insert_one(
                    {
                        "_id": lease.key,
                        "handler": route.handler_id,
                        "event_id": str(delivery.envelope.event_id),
                        "owner": lease.owner,
                        "token": lease.token,
                        "completed_at": now,
                        "expires_at": now + datetime.timedelta(seconds=self.options.retention_seconds),
                    },
                    session=session,
                )
            except DuplicateKeyError:
                # Only the completion insert can raise here (handler errors became its verdict):
                # another attempt committed this (handler, event) first.
                await self._abort(session)
                return PipelineResult(Outcome.DUPLICATE)
            except PyMongoError as exc:
                await self._abort(session)
                if exc.has_error_label(TRANSIENT):
                    raise _ReplayNeeded(f"{type(exc).__name__} ({TRANSIENT})") from exc
                return PipelineResult(Outcome.DEFERRED, "MONGO_ERROR", f"{type(exc).__name__}: {exc}"[:300])
            finally:
                scope.close()
            wrote_outbox = outbox.written > 0
            lease.committing = True
            try:
                committed = await self._commit(session, lease, execution)
            finally:
                lease.committing = False
            if committed is None:
                if wrote_outbox:
                    self.relay.wake()
                return PipelineResult(Outcome.SUCCESS)
            return committed
        finally:
            await session.end_session()

    async def _abort(self, session: AsyncClientSession) -> None:
        if session.in_transaction:
            try:
                await session.abort_transaction()
            except PyMongoError:
                _discard_server_session(session)

    async def _commit(self, session: AsyncClientSession, lease: _Lease, execution: Execution) -> PipelineResult | None:
        """Commit (None when committed); on an unknown result retry the same commit, then read the record."""
        try:
            await session.commit_transaction()
            return None
        except PyMongoError as exc:
            if not exc.has_error_label(UNKNOWN_COMMIT):
                # Not committed (MongoDB aborts it): replay in a fresh scope.
                _discard_server_session(session)
                raise _ReplayNeeded(f"commit failed: {type(exc).__name__}") from exc
        execution.reconciliations += 1
        for retry in range(self.options.commit_retries):
            await asyncio.sleep(random.uniform(0, min(self.options.backoff_max, self.options.backoff_base * 2**retry)))
            try:
                await session.commit_transaction()
                return None
            except PyMongoError as exc:
                if not exc.has_error_label(UNKNOWN_COMMIT):
                    break
        _discard_server_session(session)
        record = await self.completions.with_options(read_concern=ReadConcern("majority")).find_one({"_id": lease.key})
        if record is not None and record.get("owner") == lease.owner and record.get("token") == lease.token:
            return None
        if record is not None:
            return PipelineResult(Outcome.DUPLICATE)
        return PipelineResult(
            Outcome.DEFERRED,
            "COMMIT_AMBIGUOUS",
            "the commit result stayed unknown and no completion record is visible; the next delivery decides",
        )
