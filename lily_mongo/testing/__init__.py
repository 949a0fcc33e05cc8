"""Test your handlers without RabbitMQ: the real pipeline in-process, fault injection, an idempotence check.

:class:`TestConsumer` runs a :class:`~lily_mongo.Consumer`'s own plan through the
same engine a started consumer uses (envelope validation, dispatch, extractors,
middleware and guards, the inbox protocol against the consumer's MongoDB, the
settlement loop); only the AMQP transport is replaced. What would have been
published (retry copies, DLQ copies, outbox messages: dispatched right after
their commit, as a started consumer does) is recorded in
:attr:`TestConsumer.published`::

    async with TestConsumer(consumer) as tc:
        result = await tc.publish_json("orders.created", {"order_id": "o1"}, version=1)
        assert result.outcome == "acked"

:class:`Faults` injects MongoDB's own failures with ``configureFailPoint``
(``failCommand``), and :func:`check_idempotent` proves that duplicates,
concurrent copies and faulted attempts leave the database as one clean
delivery per event would.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import difflib
import pprint
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pymongo.errors import OperationFailure

from .._checks import check_bool, check_int
from .._engine.message import InboundMessage
from .._engine.wiring import Wiring, enter_lifespan, wire
from .._errors import ConfigError, ErrorCode, LilyError, QueueHandlerError
from .._inbox import protocol as records
from .._lifecycle import Consumer
from .._mongo.rules import TRANSIENT_LABEL, UNKNOWN_COMMIT_LABEL
from .._snapshots import TerminalObservation
from .._tasks import TaskSet
from .._text import describe_value, truncate_utf8
from ..envelope import EVENT_ID_HEADER, FAILED_QUEUE_HEADER
from ..publisher import BINARY, JSON, TEXT, CustomPublishContent, prepare_publication

if TYPE_CHECKING:
    from pymongo import AsyncMongoClient
    from pymongo.asynchronous.database import AsyncDatabase

__all__ = [
    "DeliveryResult",
    "FaultInjectionUnsupported",
    "Faults",
    "PublishedMessage",
    "TestConsumer",
    "check_idempotent",
]

_MAX_REDELIVERIES = 50
_EXCEPTION_REPR_BYTES = 160  # the exception in a DeliveryResult's repr
_INT32_MAX = 2**31 - 1  # failCommand's counts, codes and milliseconds are 32-bit integers
# Outcomes after which the broker would not deliver that copy again.
_SETTLED = frozenset({"acked", "duplicate", "retried", "dead_lettered", "broker_dead_lettered"})


class FaultInjectionUnsupported(LilyError):
    """The MongoDB server refuses ``configureFailPoint`` (MongoDB needs ``enableTestCommands=1``)."""


@dataclass(frozen=True, slots=True)
class PublishedMessage:
    """A message the consumer would have published: a retry or DLQ copy, or an outbox message."""

    kind: Literal["retry", "dlq", "outbox"]
    exchange: str
    routing_key: str
    headers: Mapping[str, Any]
    body: bytes
    content_type: str | None

    @property
    def event_id(self) -> str | None:
        value = self.headers.get(EVENT_ID_HEADER)
        return value if isinstance(value, str) else None


@dataclass(frozen=True, slots=True)
class DeliveryResult:
    """How one in-process delivery ended: its terminal ``outcome``, failure ``code`` and ``exception``."""

    observation: TerminalObservation
    settlement: str | None  # the settlement written: "ack", "nack_requeue", "reject" or None
    exception: BaseException | None = None
    """What the handler (or its middleware, guards or factories) raised on the last attempt, or None."""

    def __repr__(self) -> str:
        # One short line, so that a failed ``assert result.outcome == "acked"`` shows the cause.
        shown = "None" if self.exception is None else truncate_utf8(repr(self.exception), _EXCEPTION_REPR_BYTES)
        code = None if self.code is None else str(self.code)  # a plain string, not an ErrorCode member
        return f"DeliveryResult(outcome={self.outcome!r}, code={code!r}, exception={shown})"

    @property
    def outcome(self) -> str:
        """A :class:`~lily_mongo.settlement.Terminal` value: acked, duplicate, retried, dead_lettered, ..."""
        return self.observation.outcome

    @property
    def code(self) -> str | None:
        return self.observation.code

    @property
    def reason(self) -> str:
        return self.observation.reason

    @property
    def event_id(self) -> uuid.UUID | None:
        return self.observation.event_id


class _OpenChannel:
    is_closed = False


@dataclass(slots=True, eq=False)
class InProcessMessage:
    """One in-process delivery, settled at most once like an AMQP one."""

    queue: str
    headers: dict[str, Any]
    body: bytes
    content_type: str | None = None
    redelivered: bool = False
    exchange: str = ""
    message_id: str | None = None
    malformed: str | None = None
    channel: _OpenChannel = dataclasses.field(default_factory=_OpenChannel)
    settled: str | None = None

    @property
    def routing_key(self) -> str:
        return self.queue

    def _settle(self, how: str) -> None:
        if self.settled is not None:
            raise RuntimeError(f"delivery already settled with {self.settled}; refusing {how}")
        self.settled = how

    async def ack(self) -> None:
        self._settle("ack")

    async def nack(self, *, requeue: bool = True) -> None:
        self._settle("nack_requeue" if requeue else "reject")

    async def reject(self, *, requeue: bool = False) -> None:
        self._settle("nack_requeue" if requeue else "reject")


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
    """

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        consumer: Consumer,
        *,
        database: str | None = None,
        relay_outbox: bool = True,
        raise_handler_errors: bool = False,
    ) -> None:
        self._consumer = consumer
        self._settings = consumer.settings
        self._database = database or self._settings.database
        self._relay_outbox = relay_outbox
        self._raise_handler_errors = check_bool("raise_handler_errors", raise_handler_errors)
        self._lifespan = contextlib.AsyncExitStack()
        self._tasks = TaskSet()
        self._wiring: Wiring | None = None
        self._dlq_names: frozenset[str] = frozenset()
        self._retries_delivered = 0
        self.published: list[PublishedMessage] = []
        """Every retry copy, DLQ copy and relayed outbox message, in order."""
        self.requeued: list[InProcessMessage] = []
        """Deliveries that ended with a requeue (deferred, handoff failed): the broker would redeliver them."""

    async def __aenter__(self) -> TestConsumer:
        plan = self._consumer.plan()
        # The consumer's own settings, in this database, under an owner name of its own, reporting no telemetry.
        settings = dataclasses.replace(
            self._settings, name=f"{self._settings.name}:test", database=self._database, telemetry=None
        )
        self._dlq_names = frozenset(options.dlq_name for options in plan.queues.values())
        try:
            resources = await enter_lifespan(settings.lifespan, self._consumer, plan, self._lifespan)
            self._wiring = await wire(
                settings, plan, self._tasks, state=lambda: "running", handoff=self._handoff, resources=resources
            )
        except BaseException:
            await self._lifespan.aclose()
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
            await self._lifespan.aclose()  # after every delivery and task, as a started consumer does

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
        before = len(engine.observations)
        exception = await engine.deliver(message.queue, message)
        observation = engine.observations.items()[before] if len(engine.observations) > before else None
        assert observation is not None, "the delivery recorded no terminal observation"
        if message.settled == "nack_requeue":
            self.requeued.append(message)
        if self._relay_outbox:
            await self.relay_outbox()
        if self._raise_handler_errors and exception is not None and not isinstance(exception, QueueHandlerError):
            raise exception
        return DeliveryResult(observation, message.settled, exception)

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
        key = records.record_key(handler_id, event_id)
        await self.database[self._settings.inbox.records].replace_one(
            {"_id": key},
            {
                "_id": key,
                "handler": handler_id,
                "event_id": str(event_id),
                "state": records.LEASED,
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


class Faults:
    """MongoDB failures for a test, through the server's own ``configureFailPoint failCommand``.

    The embedded MongoDB-wire server supports it; MongoDB does when started with
    ``--setParameter enableTestCommands=1``; a server that refuses it raises
    :class:`FaultInjectionUnsupported`. Each call replaces the previous failpoint (the
    server holds one ``failCommand`` failpoint). Used as an async context manager, it
    turns the failpoint off on the way out, whatever happened inside::

        async with Faults(client) as faults:
            await faults.fail(["commitTransaction"], code=50, labels=["UnknownTransactionCommitResult"])
            ...
    """

    def __init__(self, client: AsyncMongoClient[Any]) -> None:
        self._client = client

    async def __aenter__(self) -> Faults:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.clear()

    async def fail(
        self,
        commands: Iterable[str],
        *,
        code: int = 112,
        labels: Iterable[str] = (),
        times: int | None = 1,
        close_connection: bool = False,
        block_ms: int = 0,
        message: str | None = None,
        namespace: str | None = None,
    ) -> None:
        """The next ``times`` of ``commands`` (one name or several; every one until :meth:`clear` with
        ``times=None``) fail.

        Each answers error ``code`` with the error ``labels`` (and ``message`` as its
        text). ``close_connection`` drops the connection instead of answering;
        ``block_ms`` holds the connection that long before the failure.
        ``namespace`` (``"database.collection"``) limits the failure to one
        collection, so the inbox records, heartbeats and relay traffic elsewhere
        are not hit by accident.
        """
        names = [commands] if isinstance(commands, str) else list(commands)
        if not names:
            raise ConfigError("commands must name at least one command, got none")
        for name in names:
            if not isinstance(name, str) or not name:
                raise ConfigError(f"commands must be command names, got {describe_value(name)}")
        data: dict[str, Any] = {"failCommands": names, "errorCode": check_int("code", code, 0, _INT32_MAX)}
        if error_labels := list(labels):
            data["errorLabels"] = error_labels
        if check_bool("close_connection", close_connection):
            data["closeConnection"] = True
        if check_int("block_ms", block_ms, 0, _INT32_MAX):
            data["blockConnection"] = True
            data["blockTimeMS"] = block_ms
        if message is not None:
            data["errorMessage"] = message
        if namespace is not None:
            data["namespace"] = namespace
        mode: object = "alwaysOn" if times is None else {"times": check_int("times", times, 1, _INT32_MAX)}
        await self._command({"configureFailPoint": "failCommand", "mode": mode, "data": data})

    async def transient_operations(self, times: int = 1, commands: Iterable[str] = ("insert",)) -> None:
        """The next ``times`` of ``commands`` fail with ``WriteConflict`` and ``TransientTransactionError``.

        Inserts by default: ``update`` is left out because the inbox's completion is the
        transaction's first write (an update), so a failure there replays before the handler
        ran at all; ``delete`` because the inbox releases a failed attempt's lease with one.
        """
        await self.fail(commands, times=times, labels=[TRANSIENT_LABEL], code=112)

    async def transient_commits(self, times: int = 1) -> None:
        """The next ``times`` commits fail (not applied) with ``TransientTransactionError``: the attempt replays."""
        await self.fail(["commitTransaction"], times=times, labels=[TRANSIENT_LABEL], code=112)

    async def ambiguous_commits(self, times: int = 1) -> None:
        """The next ``times`` commits answer ``UnknownTransactionCommitResult`` (the server does not apply them).

        The inbox retries the commit, then reconciles from the record. A commit that applies
        but whose reply is lost cannot be made by ``failCommand`` (it fails before the commit);
        the library's own tests cut the reply on the network for that case.
        """
        await self.fail(["commitTransaction"], times=times, labels=[UNKNOWN_COMMIT_LABEL], code=50)

    async def clear(self) -> None:
        """Turn the failpoint off (whoever set it: a test, or a process sharing the server)."""
        await self._command({"configureFailPoint": "failCommand", "mode": "off"})

    async def _command(self, command: dict[str, Any]) -> None:
        try:
            await self._client.admin.command(command)
        except OperationFailure as exc:
            raise FaultInjectionUnsupported(
                f"the server refused configureFailPoint ({exc.code}); MongoDB needs enableTestCommands=1"
            ) from exc


async def _settle_all(tc: TestConsumer, results: list[DeliveryResult]) -> list[DeliveryResult]:
    """Redeliver requeued copies until every delivery reached a final outcome (bounded)."""
    for _ in range(_MAX_REDELIVERIES):
        if not tc.requeued:
            return results
        results += await tc.redeliver_requeued()
    raise AssertionError(f"deliveries still requeued after {_MAX_REDELIVERIES} redeliveries")


# What check_idempotent tries, each alone when the run of all of them together differs.
DUPLICATE = "duplicate"
CONCURRENT = "concurrent copies"
TRANSIENT = "transient fault"
UNKNOWN_COMMIT = "unknown commit"
_SCENARIOS = (DUPLICATE, CONCURRENT, TRANSIENT, UNKNOWN_COMMIT)
_WRITE_COMMANDS = ("insert", "update", "delete", "findAndModify")
_DIFF_LINES = 40
_DIFF_LINE_BYTES = 200


@dataclass(frozen=True, slots=True)
class _Check:
    """One check_idempotent call: the consumer, what it delivers, and how."""

    consumer: Consumer
    queue: str
    events: list[tuple[uuid.UUID, Any]]
    version: int
    content: CustomPublishContent[Any]
    faults: Faults
    inbox: bool  # some handler of the queue runs under the inbox (else all are at-least-once)

    async def publish(self, tc: TestConsumer, event_id: uuid.UUID, payload: Any) -> DeliveryResult:
        return await tc.publish(self.content, self.queue, payload, version=self.version, event_id=event_id)

    async def failed_write(self, times: int) -> None:
        """An at-least-once handler's transient fault: its next write command fails (no transaction to replay)."""
        await self.faults.fail(_WRITE_COMMANDS, times=times, labels=[TRANSIENT_LABEL], code=112)

    def faults_for(self, n: int, scenarios: tuple[str, ...]) -> list[Callable[[int], Awaitable[None]]]:
        """The faults the n-th event is delivered under, one delivery each."""
        transient: list[Callable[[int], Awaitable[None]]]
        unknown: list[Callable[[int], Awaitable[None]]]
        if self.inbox:
            transient = [self.faults.transient_commits, self.faults.transient_operations]
            unknown = [self.faults.ambiguous_commits]
        else:
            transient, unknown = [self.failed_write], []  # no transaction: no commit to fail
        if len(scenarios) == len(_SCENARIOS):  # all together: one fault per event, in turn
            every = transient + unknown
            return [every[n % len(every)]]
        chosen: list[Callable[[int], Awaitable[None]]] = []
        if TRANSIENT in scenarios:
            chosen.append(transient[n % len(transient)])
        if UNKNOWN_COMMIT in scenarios:
            chosen += unknown
        return chosen

    async def run(self, tc: TestConsumer, scenarios: tuple[str, ...]) -> list[DeliveryResult]:
        """Every event through ``scenarios``, in order; then whatever the broker would deliver again."""
        results: list[DeliveryResult] = []
        for n, (event_id, payload) in enumerate(self.events):
            faults = self.faults_for(n, scenarios)
            for inject in faults:
                await inject(1)
                try:
                    results.append(await self.publish(tc, event_id, payload))
                finally:
                    await self.faults.clear()
            if not faults:
                results.append(await self.publish(tc, event_id, payload))
            if DUPLICATE in scenarios:
                results.append(await self.publish(tc, event_id, payload))
            if CONCURRENT in scenarios:
                results += await asyncio.gather(
                    self.publish(tc, event_id, payload), self.publish(tc, event_id, payload)
                )
        await _settle_all(tc, results)
        await tc.deliver_retries()
        await _settle_all(tc, results)
        return results


def _bounded_diff(clean: Any, other: Any, label: str) -> str:
    """A unified diff of the two states' pretty-printed forms, at most 40 lines of 200 bytes."""
    before = pprint.pformat(clean, width=100).splitlines()
    after = pprint.pformat(other, width=100).splitlines()
    lines = list(difflib.unified_diff(before, after, "one clean delivery per event", label, lineterm="", n=2))
    shown = [truncate_utf8(line, _DIFF_LINE_BYTES) for line in lines[:_DIFF_LINES]]
    if len(lines) > _DIFF_LINES:
        shown.append(f"... {len(lines) - _DIFF_LINES} more lines")
    return "\n".join("    " + line for line in shown)


def _clean_failure(event_id: uuid.UUID, result: DeliveryResult, inbox: bool) -> AssertionError:
    message = (
        f"check_idempotent: a clean delivery (no duplicate, no fault) of event {event_id} ended "
        f"{result.outcome} ({result.code}: {result.reason}); the handler must succeed on its own first"
    )
    if inbox and (result.code == ErrorCode.REPLAY_BUDGET_SPENT or result.observation.transient_replays):
        message += (
            ". Its attempts were replayed without any fault injected: the likely cause is a write outside "
            "mongo.session (pass session=mongo.session to every operation on mongo.database; a server "
            "that conflicts on any concurrent write, as the embedded one does, fails the attempt's own "
            "commit on such a write every time)"
        )
    elif result.exception is not None:
        message += f". The handler raised {type(result.exception).__name__}: {result.exception}"
    error = AssertionError(message)
    error.__cause__ = result.exception
    return error


async def check_idempotent(
    consumer: Consumer,
    queue: str,
    payloads: Iterable[Any],
    read_state: Callable[[AsyncDatabase[Any]], Awaitable[Any]],
    *,
    version: int = 1,
    content: CustomPublishContent[Any] = JSON,
) -> None:
    """Assert that duplicates, concurrent copies and faulted attempts change nothing a clean run would not.

    Each payload becomes one event. A clean run delivers every event once into a fresh
    database (and its retry copies, without their delays). A rough run, in another
    fresh database, delivers every event under a fault (a transient commit, a transient
    error on a write, an unknown commit result, in turn), then a duplicate copy, then
    two concurrent copies, and redelivers whatever was requeued and every retry copy.
    ``read_state(database)`` returns what the test cares about; the two runs' states
    must be equal. When they are not, each scenario (duplicate, concurrent copies,
    transient fault, unknown commit) runs alone in a fresh database, and the failure
    names those whose end state differs, with a bounded diff of the states.

    Handlers of either guarantee are checked: an at-least-once handler writes through
    ``MongoDatabase`` (the fresh databases), and its transient fault is a failed write
    (a retry follows). A clean delivery that does not succeed fails the check too; when
    it was replayed without any fault, the message names the likely cause (a write
    outside ``mongo.session``). All databases are dropped afterwards. Needs a server
    that supports ``configureFailPoint`` (see :class:`Faults`).
    """
    settings = consumer.settings
    client = settings.mongo_client
    if client is None:
        raise ConfigError("check_idempotent needs a consumer with a mongo_client")
    guarantees = {route.guarantee for route in consumer.plan().handlers if route.queue == queue}
    if not guarantees:
        raise ConfigError(f"check_idempotent: queue {queue!r} has no handler in this consumer")
    base = f"lily_idem_{uuid.uuid4().hex[:10]}"
    check = _Check(
        consumer,
        queue,
        [(uuid.uuid4(), payload) for payload in payloads],
        version,
        content,
        Faults(client),
        inbox="inbox" in guarantees,
    )
    used: list[str] = []

    async def state_after(scenarios: tuple[str, ...], name: str) -> Any:
        used.append(name)
        async with TestConsumer(consumer, database=name) as tc:
            await check.run(tc, scenarios)
        return await read_state(client[name])

    try:
        clean_name = f"{base}_clean"
        used.append(clean_name)
        async with TestConsumer(consumer, database=clean_name) as clean:
            for event_id, payload in check.events:
                result = await check.publish(clean, event_id, payload)
                result = ([result, *await clean.deliver_retries()])[-1]
                if result.outcome not in _SETTLED:
                    raise _clean_failure(event_id, result, check.inbox)
        clean_state = await read_state(client[clean_name])
        rough_state = await state_after(_SCENARIOS, f"{base}_rough")
        if rough_state == clean_state:
            return
        differing: list[tuple[str, Any]] = []
        for n, scenario in enumerate(_SCENARIOS):
            if scenario == UNKNOWN_COMMIT and not check.inbox:
                continue  # no transaction: nothing to commit
            state = await state_after((scenario,), f"{base}_s{n}")
            if state != clean_state:
                differing.append((scenario, state))
        if not differing:
            differing = [("all scenarios in turn", rough_state)]
        parts = [
            "check_idempotent: the handler is not idempotent: the end state after "
            + " and after ".join(repr(name) for name, _ in differing)
            + " differs from one clean delivery per event"
        ]
        for name, state in differing:
            parts.append(f"  {name}:\n{_bounded_diff(clean_state, state, name)}")
        if check.inbox and any(name in (TRANSIENT, UNKNOWN_COMMIT) for name, _ in differing):
            parts.append("  (a replayed attempt repeated an effect: is there a write outside mongo.session?)")
        raise AssertionError("\n".join(parts))
    finally:
        for name in used:
            await client.drop_database(name)
