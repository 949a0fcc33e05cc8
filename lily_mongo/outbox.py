"""The transactional outbox and its relay (docs/outbox.md).

Handlers write outgoing messages with ``mongo.outbox.publish_json(...)``: the
record is inserted in the attempt's transaction, so it commits (or not)
together with the handler's writes and the inbox completion record. The
relay claims pending records with a lease on the server clock, publishes them
mandatory with confirms, and marks them published (TTL retention). Several
relays (one per consumer process) may run at once: a record is published by
the holder of its claim, and downstream consumers deduplicate by event id.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, Unpack, cast

from bson import Binary
from pymongo import ReturnDocument
from pymongo.errors import PyMongoError

from ._amqp import basic_publish
from ._backoff import backoff
from ._checks import check_int, check_seconds
from ._lru import Lru
from ._mongo import ensure_index
from ._observer import NO_OBSERVER, Observer
from ._tasks import TaskSet
from .errors import ConfigError, PublishError, ScopeClosedError
from .publisher import CustomPublishContent, PublishOptions, TypedPublishing, prepare_publication

if TYPE_CHECKING:
    import aio_pika.abc
    from pymongo.asynchronous.client_session import AsyncClientSession
    from pymongo.asynchronous.collection import AsyncCollection

__all__ = ["Outbox", "OutboxRelay", "RelayOptions", "Send"]

log = logging.getLogger("lily_mongo")
T = TypeVar("T")
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class Outbox(TypedPublishing):
    """Outgoing messages of one attempt, written in its transaction. Valid for that attempt only."""

    __slots__ = ("_collection", "_handler_id", "_is_open", "_max_body", "_observer", "_session", "written")

    def __init__(
        self,
        collection: AsyncCollection[Any],
        session: AsyncClientSession,
        *,
        handler_id: str,
        max_body: int,
        is_open: Callable[[], bool],
        observer: Observer = NO_OBSERVER,
    ) -> None:
        self._collection = collection
        self._observer = observer
        self._session = session
        self._handler_id = handler_id
        self._max_body = max_body
        self._is_open = is_open
        self.written = 0

    def __repr__(self) -> str:
        return f"<Outbox written={self.written} open={self._is_open()}>"

    async def publish(
        self,
        content: CustomPublishContent[T],
        routing_key: str,
        payload: T,
        *,
        version: int,
        **options: Unpack[PublishOptions],
    ) -> uuid.UUID:
        """Stage a message with a custom content contract; it is published after the commit."""
        if not self._is_open():
            raise ScopeClosedError("the outbox of a finished attempt cannot be used")
        self._observer.outbox_record(cast("dict[str, Any]", options))  # it may add the trace context
        publication = prepare_publication(
            content, routing_key, payload, version=version, max_body=self._max_body, **options
        )
        now = utcnow()
        await self._collection.insert_one(
            {
                "_id": uuid.uuid4().hex,
                "event_id": str(publication.event_id),
                "exchange": publication.exchange,
                "routing_key": publication.routing_key,
                "body": Binary(publication.body),
                "headers": publication.headers,
                "content_type": publication.content_type,
                "handler": self._handler_id,
                "status": "pending",
                "attempts": 0,
                "created_at": now,
                "available_at": now,
            },
            session=self._session,
        )
        self.written += 1
        return publication.event_id


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayOptions:
    """How the outbox relay claims, publishes and retries records; bounds checked at construction."""

    poll_interval: float = 1.0
    claim_seconds: float = 30.0
    max_attempts: int = 10
    backoff_base: float = 0.5
    backoff_max: float = 60.0
    published_retention: float = 7 * 24 * 3600.0

    def __post_init__(self) -> None:
        # A poll period near zero is a busy loop against the database; a backoff cap below
        # its base would shorten every delay to the cap.
        seconds = {
            "poll_interval": check_seconds("RelayOptions.poll_interval", self.poll_interval, low=0.01, high=3600),
            "claim_seconds": check_seconds("RelayOptions.claim_seconds", self.claim_seconds, low=0.1, high=86400),
            "backoff_base": check_seconds("RelayOptions.backoff_base", self.backoff_base, low=0.001, high=3600),
            "published_retention": check_seconds(
                "RelayOptions.published_retention", self.published_retention, low=60, high=366 * 86400
            ),
        }
        check_int("RelayOptions.max_attempts", self.max_attempts, 1, 1000)
        seconds["backoff_max"] = check_seconds("RelayOptions.backoff_max", self.backoff_max, low=0.001, high=86400)
        if seconds["backoff_max"] < seconds["backoff_base"]:
            raise ConfigError(
                f"RelayOptions.backoff_max must be >= backoff_base ({self.backoff_base!r}), got {self.backoff_max!r}"
            )
        for name, value in seconds.items():
            object.__setattr__(self, name, value)


# At most one warning per destination this often, however many of its records are refused.
UNROUTABLE_WARNING_INTERVAL = 60.0
_WARNED_DESTINATIONS = 256  # destinations remembered for rate limiting (least recently refused forgotten)


class Send(Protocol):
    """Publish one outbox record's message, mandatory and confirmed; raise unless it was accepted."""

    def __call__(
        self, *, exchange: str, routing_key: str, body: bytes, headers: dict[str, Any], content_type: str | None
    ) -> Awaitable[None]: ...


async def _send_on(
    channel: aio_pika.abc.AbstractChannel,
    timeout: float,
    *,
    exchange: str,
    routing_key: str,
    body: bytes,
    headers: dict[str, Any],
    content_type: str | None,
) -> None:
    underlay = await channel.get_underlay_channel()
    await basic_publish(
        underlay,
        exchange=exchange,
        routing_key=routing_key,
        body=body,
        headers=headers,
        content_type=content_type,
        timeout=timeout,
    )


class OutboxRelay:
    """Publishes committed outbox records; one per consumer, owned by its supervisor.

    ``unroutable`` counts publishes the broker returned because nothing routes their
    destination (no queue of that name on the default exchange, no binding on an
    exchange); each such destination is also logged at WARNING level, at most once
    per :data:`UNROUTABLE_WARNING_INTERVAL` seconds.
    """

    def __init__(
        self, collection: AsyncCollection[Any], options: RelayOptions, owner: str, *, observer: Observer = NO_OBSERVER
    ) -> None:
        self._collection = collection
        self._observer = observer
        self._options = options
        self._owner = owner
        self._wake = asyncio.Event()
        self._stopping = False
        self._in_publish = False
        self._task: asyncio.Task[Any] | None = None
        self._channel: aio_pika.abc.AbstractChannel | None = None
        self.pending: int | None = None
        self.failed: int | None = None
        self.published = 0
        self.unroutable = 0
        # (exchange, routing key) -> (monotonic time of its last warning, refusals since)
        self._warned: Lru[tuple[str, str], tuple[float, int]] = Lru(_WARNED_DESTINATIONS)

    async def prepare(self, *, passive: bool) -> None:
        """Create the relay's indexes (idempotent), or only verify them in passive mode."""
        await ensure_index(
            self._collection, "lily_status_available", [("status", 1), ("available_at", 1)], passive=passive
        )
        await ensure_index(
            self._collection, "lily_expires_at_ttl", [("expires_at", 1)], passive=passive, expireAfterSeconds=0
        )

    async def start(self, connection: aio_pika.abc.AbstractConnection, confirm_timeout: float, tasks: TaskSet) -> None:
        """Open the relay's confirming channel and start relaying, a task of the supervisor's."""
        self._channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        self._task = tasks.spawn(self.run(self._channel, confirm_timeout), name="lily-relay")

    async def stop(self, timeout: float) -> bool:
        """Stop after the in-flight publish settles or ``timeout`` ends; True if the relay ended."""
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

    def wake(self) -> None:
        """Run a relay pass now (called right after a commit that wrote outbox records)."""
        self._wake.set()

    async def run(self, channel: aio_pika.abc.AbstractChannel, confirm_timeout: float) -> None:
        """Relay until stopped: claim, publish with confirm, mark; poll when idle."""
        while not self._stopping:
            if channel.is_closed:
                # The broker closed the channel (e.g. a record named a missing exchange);
                # the robust channel reopens it. Claim nothing meanwhile.
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=self._options.poll_interval)
                continue
            try:
                record = await self._claim()
            except PyMongoError as exc:
                log.warning("outbox claim failed: %s", type(exc).__name__)
                record = None
            if record is None:
                await self._refresh_counts()
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=self._options.poll_interval)
                continue
            self._in_publish = True
            try:
                await self._publish(record, functools.partial(_send_on, channel, confirm_timeout))
            finally:
                self._in_publish = False

    async def drain(self, send: Send) -> int:
        """Claim and publish through ``send`` until no record is available; returns how many were sent.

        For in-process transports (:class:`lily_mongo.testing.TestConsumer`): the same claim,
        publish and mark steps as :meth:`run`, without a channel.
        """
        sent = 0
        while (record := await self._claim()) is not None:
            published = self.published
            await self._publish(record, send)
            sent += self.published - published
        await self._refresh_counts()
        return sent

    async def _refresh_counts(self) -> None:
        try:
            self.pending = await self._collection.count_documents({"status": "pending"})
            self.failed = await self._collection.count_documents({"status": "failed"})
        except PyMongoError:
            pass

    async def _claim(self) -> dict[str, Any] | None:
        token = uuid.uuid4().hex
        claim_ms = int(self._options.claim_seconds * 1000)
        record: dict[str, Any] | None = await self._collection.find_one_and_update(
            {
                "status": "pending",
                "available_at": {"$lte": utcnow()},
                "$expr": {"$lte": [{"$ifNull": ["$claim_expires", _EPOCH]}, "$$NOW"]},
            },
            [
                {
                    "$set": {
                        "claim_owner": self._owner,
                        "claim_token": token,
                        "claim_expires": {"$add": ["$$NOW", claim_ms]},
                    }
                }
            ],
            sort=[("available_at", 1)],
            return_document=ReturnDocument.AFTER,
        )
        return record

    async def _publish(self, record: dict[str, Any], send: Send) -> None:
        fence = {"_id": record.get("_id"), "claim_token": record.get("claim_token")}
        try:
            publish = functools.partial(
                send,
                exchange=record["exchange"],
                routing_key=record["routing_key"],
                body=bytes(record["body"]),
                content_type=record.get("content_type"),
            )
            await self._observer.relay_publish(lambda headers: publish(headers=headers), record)
        except Exception as exc:
            # Any failure of one record (broker refusal, a record that cannot be encoded
            # or is malformed) is a failed attempt of that record; the relay goes on.
            attempts = int(record.get("attempts", 0)) + 1
            kind = exc.kind if isinstance(exc, PublishError) else f"failed ({type(exc).__name__})"
            failed = attempts >= self._options.max_attempts
            if kind == "unroutable":
                self.unroutable += 1
                self._warn_unroutable(record)
            if failed:
                log.warning(
                    "outbox record %s (%s) parked as failed after %d attempts: publish %s; set its status back "
                    "to pending once the destination accepts it",
                    record.get("_id"),
                    _destination(record),
                    attempts,
                    kind,
                )
            delay = backoff(
                attempts - 1, base=self._options.backoff_base, cap=self._options.backoff_max, jitter=random.random()
            )
            update: dict[str, Any] = {
                "attempts": attempts,
                "last_error": f"publish {kind}",
                "available_at": utcnow() + datetime.timedelta(seconds=delay),
                "status": "failed" if failed else "pending",
            }
            try:
                await self._collection.update_one(fence, {"$set": update, "$unset": {"claim_expires": ""}})
            except PyMongoError:
                log.warning("outbox record could not be updated after a failed publish", exc_info=True)
            return
        self._warned.forget((str(record.get("exchange", "")), str(record.get("routing_key", ""))))
        now = utcnow()
        try:
            marked = await self._collection.update_one(
                fence,
                {
                    "$set": {
                        "status": "published",
                        "published_at": now,
                        "expires_at": now + datetime.timedelta(seconds=self._options.published_retention),
                    },
                    "$unset": {"claim_expires": ""},
                },
            )
            if marked.matched_count:
                self.published += 1
        except PyMongoError:
            # Published but not marked: the claim expires and the record is published
            # again (at-least-once); downstream consumers deduplicate by event id.
            log.warning("outbox record published but not marked", exc_info=True)

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
            "destination (the consuming service's queue, or a binding) or fix the routing key; the relay retries "
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
