"""``TestConsumer``: a consumer's own pipeline in-process (docs/testing.md)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from .._checks import check_bool
from .._engine.message import InboundMessage
from .._engine.wiring import Wiring, enter_lifespan, wire
from .._errors import ConfigError, LilyError, QueueHandlerError
from .._headers import FAILED_QUEUE_HEADER
from .._inbox import protocol
from .._lifecycle import Consumer
from .._snapshots import TerminalObservation
from .._tasks import TaskSet
from ..publisher import BINARY, JSON, TEXT, CustomPublishContent, prepare_publication
from ._results import DeliveryResult, PublishedMessage
from ._transport import InProcessMessage
from ._writes import SessionlessWrite, WriteLog, watched

if TYPE_CHECKING:
    from pymongo.asynchronous.database import AsyncDatabase
    from pymongo.asynchronous.mongo_client import AsyncMongoClient


_MAX_REDELIVERIES = 50


class TestConsumer:
    """A consumer's plan running in-process against its MongoDB, with the AMQP transport recorded.

    ``database`` overrides the consumer's database (the inbox records, the outbox,
    ``MongoScope.database`` and ``MongoDatabase`` all live there). Deliveries run one at a
    time unless the test runs several ``publish_*`` calls concurrently (``asyncio.gather``).
    The consumer's lifespan is entered on the way in and exited on the way out; its
    resources are the handlers' ``Resource`` values. With ``raise_handler_errors=True`` a
    delivery whose handler raised an unexpected exception (anything but
    ``QueueHandlerError``) re-raises it from ``publish_*``, once the delivery has settled.

    A committed attempt's outbox records go to the consumer's own dispatcher, whose send
    records them in :attr:`published`; each ``publish_*`` returns once they are published
    and marked. With ``relay_outbox=False`` no dispatcher runs: the records stay in the
    outbox collection until :meth:`relay_outbox` publishes them as the backstop relay would.

    A client the consumer owns (``owns_mongo_client=True``) is closed on the way out, as a
    started consumer closes it. The handlers' client is a copy of the consumer's with a command
    log (``watch_writes``): a write that a handler under the inbox made outside ``mongo.session``
    is named in its delivery's result (:attr:`DeliveryResult.hint`, and its repr).
    """

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        consumer: Consumer,
        *,
        database: str | None = None,
        relay_outbox: bool = True,
        raise_handler_errors: bool = False,
        watch_writes: bool = True,
    ) -> None:
        self._consumer = consumer
        self._settings = consumer.settings
        self._database = database or self._settings.database
        self._relay_outbox = relay_outbox
        self._raise_handler_errors = check_bool("raise_handler_errors", raise_handler_errors)
        self._watch_writes = check_bool("watch_writes", watch_writes)
        self._writes: WriteLog | None = None
        self._watched: AsyncMongoClient[Any] | None = None
        self._inbox_queues: frozenset[str] = frozenset()
        self._lifespan = contextlib.AsyncExitStack()
        self._tasks = TaskSet()
        self._wiring: Wiring | None = None
        self._dlq_names: frozenset[str] = frozenset()
        self._retries_delivered = 0
        self.published: list[PublishedMessage] = []
        """Every retry copy, DLQ copy and relayed outbox message, in order."""
        self.sessionless_writes: list[SessionlessWrite] = []
        """Every write a handler under the inbox made outside ``mongo.session`` (with ``watch_writes``)."""
        self.requeued: list[InProcessMessage] = []
        """Deliveries that ended with a requeue (deferred, handoff failed): the broker would redeliver them."""

    async def __aenter__(self) -> TestConsumer:
        plan = self._consumer.plan()
        # The consumer's own settings, in this database, under an owner name of its own, reporting no telemetry.
        settings = dataclasses.replace(
            self._settings, name=f"{self._settings.name}:test", database=self._database, telemetry=None
        )
        client = settings.mongo_client
        if client is not None and self._watch_writes:
            self._writes = WriteLog({settings.inbox.records, settings.outbox.collection})
            self._watched = watched(client, self._writes)
            if self._watched is not None:
                settings = dataclasses.replace(settings, mongo_client=self._watched)
        by_queue: dict[str, set[str]] = {}
        for route in plan.handlers:
            by_queue.setdefault(route.queue, set()).add(route.guarantee)
        self._inbox_queues = frozenset(q for q, guarantees in by_queue.items() if guarantees == {"inbox"})
        self._dlq_names = frozenset(options.dlq_name for options in plan.queues.values())
        try:
            resources = await enter_lifespan(settings.lifespan, self._consumer, plan, self._lifespan)
            self._wiring = await wire(
                settings, plan, self._tasks, state=lambda: "running", handoff=self._handoff, resources=resources
            )
        except BaseException:
            await self._lifespan.aclose()
            await self._close_watched()
            raise
        self._wiring.open_in_process(self._tasks, self._record_outbox if self._relay_outbox else None)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            pending = self._tasks.pending()
            for task in pending:
                task.cancel()
            await self._tasks.join(pending, self._settings.force_timeout)
            if self._wiring is not None:
                self._wiring.engine.failures.flush()
        finally:
            try:
                await self._lifespan.aclose()  # after every delivery and task, as a started consumer does
            finally:
                await self._close_watched()
                client = self._settings.mongo_client
                if self._settings.owns_mongo_client and client is not None:
                    await client.close()  # as a started consumer closes the client it owns

    async def _close_watched(self) -> None:
        watched_client, self._watched = self._watched, None
        if watched_client is not None:
            await watched_client.close()

    @property
    def database(self) -> AsyncDatabase[Any]:
        """The database the handlers write to (``MongoScope.database``)."""
        client = self._settings.mongo_client
        if client is None or self._database is None:
            raise ConfigError("this consumer has no mongo_client")
        return client[self._database]

    @property
    def observations(self) -> tuple[TerminalObservation, ...]:
        return self._wiring.engine.observations.items() if self._wiring is not None else ()

    # -- publishing into the consumer --------------------------------------------------------

    async def publish[T](
        self, content: CustomPublishContent[T], queue: str, payload: T, *, version: int, **options: Any
    ) -> DeliveryResult:
        """Encode like :class:`~lily_mongo.Publisher` does, then deliver to ``queue`` and return the result."""
        publication = prepare_publication(content, queue, payload, version=version, **options)
        return await self.publish_raw(
            queue, headers=publication.headers, body=publication.body, content_type=publication.content_type
        )

    async def publish_many[T](
        self,
        queue: str,
        payloads: Sequence[T],
        *,
        version: int,
        content: CustomPublishContent[T] = JSON,
        event_ids: Sequence[uuid.UUID | None] | None = None,
        **options: Any,
    ) -> list[DeliveryResult]:
        """Deliver every payload at once, as a broker would push them: a batch handler's batches form from them
        (docs/testing.md, "Batch handlers"). ``event_ids`` gives copies of one event (the same id twice: a
        duplicate inside a batch); their results come back in order."""
        ids = event_ids if event_ids is not None else [None] * len(payloads)
        if len(ids) != len(payloads):
            raise ConfigError(f"event_ids has {len(ids)} ids for {len(payloads)} payloads")
        messages = []
        for payload, event_id in zip(payloads, ids, strict=True):
            extra = dict(options) if event_id is None else {**options, "event_id": event_id}
            publication = prepare_publication(content, queue, payload, version=version, **extra)
            messages.append(
                InProcessMessage(queue, dict(publication.headers), publication.body, publication.content_type, False)
            )
        return list(await asyncio.gather(*(self._deliver(message) for message in messages)))

    async def publish_json(self, queue: str, payload: Any, *, version: int, **options: Any) -> DeliveryResult:
        return await self.publish(JSON, queue, payload, version=version, **options)

    async def publish_text(self, queue: str, payload: str, *, version: int, **options: Any) -> DeliveryResult:
        return await self.publish(TEXT, queue, payload, version=version, **options)

    async def publish_binary(self, queue: str, payload: bytes, *, version: int, **options: Any) -> DeliveryResult:
        return await self.publish(BINARY, queue, payload, version=version, **options)

    async def publish_raw(
        self,
        queue: str,
        *,
        headers: Mapping[str, Any],
        body: bytes,
        content_type: str | None = None,
        redelivered: bool = False,
    ) -> DeliveryResult:
        """Deliver exactly these headers and body (any contract case, valid or not)."""
        return await self._deliver(InProcessMessage(queue, dict(headers), body, content_type, redelivered))

    async def _deliver(self, message: InProcessMessage) -> DeliveryResult:
        if self._wiring is None:
            raise LilyError("use the TestConsumer as an async context manager")
        engine = self._wiring.engine
        if message.queue not in engine.queues:
            raise ConfigError(f"queue {message.queue!r} has no handler in this consumer")
        mark = len(self._writes.writes) if self._writes is not None else 0
        exception = await engine.deliver(message.queue, message)
        outside: tuple[SessionlessWrite, ...] = ()
        if self._writes is not None and self._watched is not None and message.queue in self._inbox_queues:
            outside = tuple(self._writes.since(mark))
            self.sessionless_writes += outside
        # Its own: the engine records a delivery's observation last thing before deliver() returns, with no
        # wait between, so deliveries run at once (publish_many, asyncio.gather) each find their own.
        recorded = engine.observations.items()
        observation = recorded[-1] if recorded else None
        assert observation is not None, "the delivery recorded no terminal observation"
        if message.settled == "nack_requeue":
            self.requeued.append(message)
        if self._relay_outbox:
            await self.relay_outbox()
        if self._raise_handler_errors and exception is not None and not isinstance(exception, QueueHandlerError):
            raise exception
        return DeliveryResult(observation, message.settled, exception, outside)

    # -- what the broker would do next -------------------------------------------------------

    async def relay_outbox(self) -> int:
        """Publish every committed outbox record (recorded in :attr:`published`); returns how many.

        What the dispatcher was handed is published and marked first; then the backstop relay's
        batches take whatever else is due (records written with ``relay_outbox=False``, or whose
        dispatch failed and whose backoff has passed)."""
        outbox = self._wiring.outbox if self._wiring is not None else None
        if outbox is None:
            return 0
        before = outbox.counters.published
        await outbox.dispatched()
        await outbox.relay.drain(self._record_outbox)
        return outbox.counters.published - before

    async def deliver_retries(self) -> list[DeliveryResult]:
        """Deliver the retry copies recorded so far to their queues, without the buckets' delays."""
        results: list[DeliveryResult] = []
        while True:
            copies = [m for m in self.published if m.kind == "retry"]
            if self._retries_delivered >= len(copies):
                return results
            copy = copies[self._retries_delivered]
            self._retries_delivered += 1
            queue = str(copy.headers.get(FAILED_QUEUE_HEADER, ""))
            results.append(
                await self._deliver(InProcessMessage(queue, dict(copy.headers), copy.body, copy.content_type, False))
            )

    async def redeliver_requeued(self) -> list[DeliveryResult]:
        """Deliver the requeued deliveries again (``redelivered=True``), as the broker would."""
        pending, self.requeued = self.requeued, []
        return [
            await self._deliver(InProcessMessage(m.queue, m.headers, m.body, m.content_type, True, m.exchange))
            for m in pending
        ]

    async def hold_lease(self, handler_id: str, event_id: uuid.UUID, *, seconds: float = 3600) -> None:
        """Make another, live owner hold the lease of (handler, event) for ``seconds``: copies are deferred."""
        now = datetime.datetime.now(datetime.UTC)
        key = protocol.record_key(handler_id, event_id)
        await self.database[self._settings.inbox.records].replace_one(
            {"_id": key},
            {
                "_id": key,
                "handler": handler_id,
                "event_id": str(event_id),
                "state": protocol.LEASED,
                "owner": "elsewhere:test:0",
                "token": 1,
                "expires_at": now + datetime.timedelta(seconds=seconds),
                "purge_at": now + datetime.timedelta(seconds=seconds + 3600),
                "acquisitions": 1,
                "deferrals": 0,
            },
            upsert=True,
        )

    # -- the recorded transport --------------------------------------------------------------

    async def _handoff(self, message: InboundMessage, routing_key: str, headers: Mapping[str, Any]) -> None:
        kind: Literal["retry", "dlq"] = "dlq" if routing_key in self._dlq_names else "retry"
        self.published.append(
            PublishedMessage(kind, "", routing_key, dict(headers), bytes(message.body), message.content_type)
        )

    async def _record_outbox(
        self, *, exchange: str, routing_key: str, body: bytes, headers: dict[str, Any], content_type: str | None
    ) -> None:
        self.published.append(PublishedMessage("outbox", exchange, routing_key, dict(headers), body, content_type))
