"""``check_idempotent``: duplicates, concurrent copies and faulted attempts leave the database as one clean
delivery per event would (docs/testing.md)."""

from __future__ import annotations

import asyncio
import difflib
import pprint
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import ConfigError, ErrorCode, QueueHandlerError
from .._lifecycle import Consumer
from .._mongo.rules import TRANSIENT_LABEL
from .._text import truncate_utf8
from ..publisher import JSON, CustomPublishContent
from ._consumer import _MAX_REDELIVERIES, TestConsumer
from ._faults import Faults
from ._results import DeliveryResult
from ._writes import SessionlessWrite, outside_session_hint

if TYPE_CHECKING:
    from pymongo.asynchronous.database import AsyncDatabase


async def _settle_all(tc: TestConsumer, results: list[DeliveryResult]) -> list[DeliveryResult]:
    """Redeliver requeued copies until every delivery reached a final outcome (bounded)."""
    for _ in range(_MAX_REDELIVERIES):
        if not tc.requeued:
            return results
        results += await tc.redeliver_requeued()
    raise AssertionError(f"deliveries still requeued after {_MAX_REDELIVERIES} redeliveries")


DUPLICATE = "duplicate"


CONCURRENT = "concurrent copies"


TRANSIENT = "transient fault"


UNKNOWN_COMMIT = "unknown commit"


_SCENARIOS = (DUPLICATE, CONCURRENT, TRANSIENT, UNKNOWN_COMMIT)


_WRITE_COMMANDS = ("insert", "update", "delete", "findAndModify")


_DIFF_LINES = 40


_SUCCEEDED = frozenset({"acked", "duplicate"})


def _handled(result: DeliveryResult) -> bool:
    """A clean delivery's end that the handler chose: acked, or refused on purpose (a permanent
    ``QueueHandlerError``, dead-lettered at once). Retries spent on any other failure are not."""
    if result.outcome in _SUCCEEDED:
        return True
    refused = result.exception
    return result.outcome == "dead_lettered" and isinstance(refused, QueueHandlerError) and not refused.is_retryable


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
    batch: bool = False  # a batch handler serves the queue: events are delivered together, in batches

    async def publish_all(self, tc: TestConsumer, copies: int = 1) -> list[DeliveryResult]:
        """Every event delivered at once (``copies`` copies of each, side by side): they form batches."""
        ids = [event_id for event_id, _ in self.events for _ in range(copies)]
        payloads = [payload for _, payload in self.events for _ in range(copies)]
        return await tc.publish_many(self.queue, payloads, version=self.version, content=self.content, event_ids=ids)

    async def clean_run(self, tc: TestConsumer) -> None:
        """Every event once (a batch handler's together, in batches) and its retry copies; each must settle."""
        if self.batch:
            firsts = await self.publish_all(tc)
            retried = {r.event_id: r for r in await tc.deliver_retries()}
            ends = [retried.get(event_id, first) for (event_id, _), first in zip(self.events, firsts, strict=True)]
        else:
            ends = []
            for event_id, payload in self.events:
                result = await self.publish(tc, event_id, payload)
                ends.append(([result, *await tc.deliver_retries()])[-1])
        for (event_id, _), result in zip(self.events, ends, strict=True):
            if not _handled(result):
                raise _clean_failure(event_id, result, self.inbox)

    async def run_batches(self, tc: TestConsumer, scenarios: tuple[str, ...]) -> list[DeliveryResult]:
        """A batch handler's rough run: every event delivered in batches under each fault in turn, then
        duplicates inside one batch and across batches, and concurrent batches of the same events."""
        results: list[DeliveryResult] = []
        faults: list[Callable[[int], Awaitable[None]]] = []
        for n in range(2):  # each kind of fault in turn (a transient commit, then a transient write)
            for fault in self.faults_for(n, tuple(s for s in scenarios if s in (TRANSIENT, UNKNOWN_COMMIT))):
                if fault not in faults:
                    faults.append(fault)
        plan: list[Callable[[int], Awaitable[None]] | None] = [*faults] or [None]
        for inject in plan:
            if inject is not None:
                await inject(1)
            try:
                results += await self.publish_all(tc)
            finally:
                await self.faults.clear()
        if DUPLICATE in scenarios:
            results += await self.publish_all(tc, copies=2)  # two copies of each event in one batch
            results += await self.publish_all(tc)  # and in later batches
        if CONCURRENT in scenarios:
            for batch in await asyncio.gather(self.publish_all(tc), self.publish_all(tc)):
                results += batch
        await _settle_all(tc, results)
        await tc.deliver_retries()
        await _settle_all(tc, results)
        return results

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
        if self.batch:
            return await self.run_batches(tc, scenarios)
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
        f"{result.outcome} ({result.code}: {result.reason}), not acked; the handler must succeed on its own "
        "first (or refuse the event with a permanent QueueHandlerError)"
    )
    if result.hint:
        message += f". {result.hint}"
    elif inbox and (result.code == ErrorCode.REPLAY_BUDGET_SPENT or result.observation.transient_replays):
        message += (
            ". Its attempts were replayed without any fault injected: the likely cause is a write outside "
            "mongo.session, or a write that conflicts with another on the same document"
        )
    if result.exception is not None:
        message += f". The handler raised {type(result.exception).__name__}: {result.exception}"
    error = AssertionError(message)
    error.__cause__ = result.exception
    return error


def _outside_failure(writes: list[SessionlessWrite]) -> AssertionError:
    """The handler wrote outside its attempt's transaction: a replay would repeat the write."""
    collections = sorted({f"{w.database}.{w.collection}" for w in writes})
    return AssertionError(
        "check_idempotent: the handler wrote outside its attempt's transaction, into "
        + ", ".join(repr(name) for name in collections)
        + f" ({len(writes)} write{'s' if len(writes) != 1 else ''} in a clean run); such a write survives the "
        "attempt's abort and a replay makes it again. Likely cause: " + outside_session_hint(writes)
    )


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
    (a retry follows). A clean delivery that does not end acked fails the check too,
    naming its outcome. A handler under the inbox whose clean run writes outside
    ``mongo.session`` (the command log of :class:`TestConsumer` shows a write outside any
    transaction) fails it, naming the collection and the likely cause. A batch handler's
    queue gets its events delivered together, so that they form batches: under each fault in
    turn, then with two copies of every event in one batch and more in later batches, then as
    two concurrent sets. All databases are dropped afterwards. Needs a server that supports
    ``configureFailPoint`` (see :class:`Faults`).
    """
    settings = consumer.settings
    client = settings.mongo_client
    if client is None:
        raise ConfigError("check_idempotent needs a consumer with a mongo_client")
    routes = [route for route in consumer.plan().handlers if route.queue == queue]
    guarantees = {route.guarantee for route in routes}
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
        batch=any(route.batch is not None for route in routes),
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
            await check.clean_run(clean)
        if clean.sessionless_writes:
            raise _outside_failure(clean.sessionless_writes)
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
