"""The inbox: a lily_mongo inbox consumer against a hand-written inbox consumer, same broker, same MongoDB.

Run: ``python benchmarks/bench_inbox.py [--messages 400] [--rounds 5] [--concurrency 1 4]
[--duplicates 0.1] [--prefetch 64] [--relay] [--lease-first] [--json]``
(``LILY_MONGO_URI`` selects MongoDB, a replica set; unset, the embedded
MongoDB-wire emulator is started for the run. ``LILY_AMQP_URL`` selects the
broker; default the local RabbitMQ as guest.)

Both contenders consume the same messages (JSON ``{"order_id", "amount"}``
published with ``lily_mongo.Publisher``, so they carry the canonical envelope
headers) and make the same handler write: one business ``insert_one`` per
event inside the transaction.

* lily: ``Consumer(..., mongo_client=AsyncMongoClient(uri, event_listeners=[...]))``
  with an inbox handler taking ``Json[Order]``, ``EventId`` and ``MongoScope``;
  the outbox relay is off (``OutboxOptions(run_relay=False)``) unless ``--relay``;
  first-time copies claim their record inside the transaction (the default)
  unless ``--lease-first`` (``InboxOptions(claim_in_transaction=False)``: every
  copy takes the lease claim first, the 3 + k path of docs/inbox.md).
* hand: what a competent user writes with aio-pika and ``pymongo.AsyncMongoClient``:
  prefetch, a semaphore for the concurrency, and per message a session and a
  transaction (snapshot read concern, majority write concern) that inserts the
  inbox document ``{_id: "<handler>|<event id>"}`` (DuplicateKeyError →
  duplicate → ACK) and the business document, then commits; the whole
  transaction is replayed on the ``TransientTransactionError`` label and on a
  commit error without ``UnknownTransactionCommitResult`` (jittered backoff,
  the same budget as lily's default), a commit with an unknown result is
  retried; ACK after the commit.

Each run is one contender in its own fresh process, on a fresh queue and a
fresh database (dropped afterwards). The queue is filled before the process
starts; the process times the first phase from its first delivery (the first
MongoDB command that names an event) to its last ACK, with the process CPU time
over the same window. Then the parent publishes a second copy of a fraction of
the events (``--duplicates``) and the process consumes them as a separate
phase. Rounds run both contenders at every concurrency, in alternating order;
the throughput ratio lily/hand is the median of the per-round ratios.

Commands are counted with a ``pymongo.monitoring.CommandListener`` on the
consumer's own client (the benchmark's set-up and checks use other clients).
A command is charged to the event whose id it carries (a transaction's
``commitTransaction``/``abortTransaction`` to the event of the transaction's
earlier commands); commands that name no event (index set-up, ``endSessions``
at close, relay polling) are listed apart and not charged to deliveries.
PyMongo reports server monitoring (``hello`` heartbeats) to server listeners,
not to command listeners, so it is not counted at all. A replay is one more
transaction started for the same event in the same phase.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import platform
import random
import re
import resource
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aio_pika
import aio_pika.abc
import pydantic
from pymongo import AsyncMongoClient, monitoring
from pymongo.errors import DuplicateKeyError, PyMongoError
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lily_mongo import (
    Consumer,
    EventId,
    InboxOptions,
    Json,
    MongoScope,
    OutboxOptions,
    Publisher,
    QueueOptions,
    RetryPolicy,
    queue,
)

SCRIPT = Path(__file__).resolve()
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
EVENT_ID_HEADER = "x-lily-event-id"  # docs/contracts.md
BUSINESS = "bench_orders"
HAND_INBOX = "bench_hand_inbox"
HAND_HANDLER = "bench.orders/v1/record_order"
TRANSIENT = "TransientTransactionError"
UNKNOWN_COMMIT = "UnknownTransactionCommitResult"
# The hand-written consumer's replay budget and backoff: lily's defaults (InboxOptions).
REPLAY_BUDGET = 5
COMMIT_RETRIES = 3
BACKOFF_BASE = 0.02
BACKOFF_MAX = 1.0
POLL = 0.002  # both contenders' end of phase is noticed by the same poll
PUBLISH_BATCH = 100
KINDS = ("hand", "lily")
LABELS = {"hand": "hand-written (aio-pika + PyMongo)", "lily": "lily_mongo inbox"}
PHASE_NAMES = {"first": "start-up and first-time phase", "dups": "duplicate phase", "teardown": "shutdown"}
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_OUTCOME_ERROR = "RUN FAILED"

log = logging.getLogger("bench_inbox")


class Order(pydantic.BaseModel):
    order_id: str
    amount: int


def business_document(event_id: str, order: Order) -> dict[str, Any]:
    return {"event_id": event_id, "order_id": order.order_id, "amount": order.amount}


# -- the command stream ---------------------------------------------------------------------------


class CommandLog(monitoring.CommandListener):
    """Every command the consumer's own client sends, kept by reference and analysed after the run.

    The hot path appends one tuple per command and keeps each round trip's
    duration; ``mark`` records wall and CPU time at the phase's first command
    that names an event (its first delivery).
    """

    def __init__(self) -> None:
        self.phase = "first"
        self.commands: list[tuple[str, int, str, Mapping[str, Any]]] = []
        self.failures: dict[int, str] = {}
        self.durations: dict[int, int] = {}
        self.mark: tuple[float, float, float] | None = None

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        command = event.command
        self.commands.append((self.phase, event.request_id, event.command_name, command))
        if self.mark is None and _UUID.search(repr(command)):
            self.mark = (time.perf_counter(), *cpu_times())

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        self.durations[event.request_id] = event.duration_micros
        errors = event.reply.get("writeErrors")
        if errors:
            self.failures[event.request_id] = failure_name(errors[0])

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        self.durations[event.request_id] = event.duration_micros
        self.failures[event.request_id] = failure_name(event.failure)

    def rearm(self, phase: str) -> None:
        self.phase = phase
        self.mark = None


def failure_name(error: Mapping[str, Any]) -> str:
    if error.get("codeName"):
        return str(error["codeName"])
    if error.get("code"):
        return "DuplicateKey" if error["code"] == 11000 else f"code {error['code']}"
    return repr(str(error.get("errmsg", "error"))[:40])


def cpu_times() -> tuple[float, float]:
    """User and system CPU seconds of this process (sending on a socket costs system time)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def analyse(log_: CommandLog) -> dict[str, Any]:
    """Charge every command to an event (by the id it carries, or its transaction's); the rest apart."""
    by_txn: dict[tuple[bytes, int], str] = {}
    phases: dict[str, dict[str, list[tuple[str, str | None, bool]]]] = {
        "first": collections.defaultdict(list),
        "dups": collections.defaultdict(list),
    }
    apart: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    micros: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for phase, request_id, name, command in log_.commands:
        lsid = command.get("lsid")
        txn = (bytes(lsid["id"]), int(command["txnNumber"])) if lsid and "txnNumber" in command else None
        found = _UUID.search(repr(command))
        event = found.group(0) if found else by_txn.get(txn) if txn else None
        if event is not None and txn is not None:
            by_txn[txn] = event
        if event is None or phase not in phases:
            target = command.get(name)
            where = f" {target}" if isinstance(target, str) else ""
            apart[phase][f"{name}{where}"] += 1
            continue
        phases[phase][event].append((name, log_.failures.get(request_id), bool(command.get("startTransaction"))))
        if request_id in log_.durations:
            micros[phase][name] += log_.durations[request_id]
            micros[phase][f"{name} n"] += 1
    return {
        "first": phase_profile(phases["first"]) | {"micros": dict(micros["first"])},
        "dups": phase_profile(phases["dups"]) | {"micros": dict(micros["dups"])},
        "not_charged": {phase: dict(counts) for phase, counts in apart.items()},
    }


def phase_profile(events: Mapping[str, list[tuple[str, str | None, bool]]]) -> dict[str, Any]:
    """Totals by command name; the profile of events without a replay; replays and what they cost."""
    totals: collections.Counter[str] = collections.Counter()
    failed: collections.Counter[str] = collections.Counter()
    clean: collections.Counter[str] = collections.Counter()
    clean_failed: collections.Counter[str] = collections.Counter()
    other: collections.Counter[str] = collections.Counter()
    clean_events = replays = replayed_events = 0
    for commands in events.values():
        names = collections.Counter(name for name, _, _ in commands)
        fails = collections.Counter(f"{name} {code}" for name, code, _ in commands if code)
        totals.update(names)
        failed.update(fails)
        extra = max(sum(starts for _, _, starts in commands) - 1, 0)
        replays += extra
        if extra:
            replayed_events += 1
            other.update(names)
        else:
            clean_events += 1
            clean.update(names)
            clean_failed.update(fails)
    return {
        "events": len(events),
        "totals": dict(totals),
        "failed": dict(failed),
        "clean_events": clean_events,
        "clean": dict(clean),
        "clean_failed": dict(clean_failed),
        "replays": replays,
        "replayed_events": replayed_events,
        "replayed_totals": dict(other),
    }


# -- the contenders (each runs in a child process) ------------------------------------------------


class Phases:
    """Counts finished deliveries; ends a phase at a count, with its wall and CPU time."""

    def __init__(self, commands: CommandLog, done: Callable[[], int], timeout: float) -> None:
        self.commands = commands
        self.done = done
        self.timeout = timeout

    async def run(self, target: int, count: int) -> dict[str, float]:
        """Wait until ``target`` deliveries finished in all; this phase has ``count`` of them."""
        if count == 0:
            return {"seconds": 0.0, "cpu": 0.0, "cpu_sys": 0.0}
        deadline = time.monotonic() + self.timeout
        while self.done() < target:
            if time.monotonic() > deadline:
                raise SystemExit(f"{_OUTCOME_ERROR}: {self.done()} of {target} deliveries finished in {self.timeout} s")
            await asyncio.sleep(POLL)
        ended = time.perf_counter(), *cpu_times()
        mark = self.commands.mark
        if mark is None:
            raise SystemExit(f"{_OUTCOME_ERROR}: no command named an event in this phase")
        user, system = ended[1] - mark[1], ended[2] - mark[2]
        return {"seconds": ended[0] - mark[0], "cpu": user + system, "cpu_sys": system}


def announce(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


async def child_lily(config: dict[str, Any], commands: CommandLog) -> dict[str, Any]:
    name = config["queue"]

    @queue(name, version=1, content="json")
    async def record_order(order: Json[Order], event_id: EventId, mongo: MongoScope) -> None:
        await mongo.database[BUSINESS].insert_one(business_document(str(event_id), order), session=mongo.session)

    client: AsyncMongoClient[Any] = AsyncMongoClient(
        config["mongo_uri"], event_listeners=[commands], serverSelectionTimeoutMS=10_000
    )
    consumer = Consumer(
        amqp_url=config["amqp_url"],
        name="bench-inbox",
        mongo_client=client,
        database=config["database"],
        inbox=InboxOptions(claim_in_transaction=not config["lease_first"]),
        outbox=OutboxOptions(run_relay=config["relay"]),
    )
    consumer.configure_queue(
        name,
        concurrency=config["concurrency"],
        prefetch=config["prefetch"],
        retry=RetryPolicy(max_retries=0, delays=()),
        passive=True,
    )
    consumer.include(record_order)
    managed = await consumer.start()

    def outcomes() -> Mapping[str, int]:
        return managed.snapshot().queues[0].outcomes

    def done() -> int:
        counts = outcomes()
        unexpected = {k: v for k, v in counts.items() if k not in ("acked", "duplicate", "deferred") and v}
        if unexpected:
            raise SystemExit(f"{_OUTCOME_ERROR}: unexpected outcomes {unexpected}")
        return counts.get("acked", 0) + counts.get("duplicate", 0)

    phases = Phases(commands, done, config["timeout"])
    try:
        first = await phases.run(config["messages"], config["messages"])
        snap = managed.snapshot().queues[0]
        first |= {"deliveries": snap.received, "reported_replays": snap.transient_replays, "deferrals": snap.deferrals}
        commands.rearm("dups")
        announce(phase="first_done")
        dups = await phases.run(config["messages"] + config["duplicates"], config["duplicates"])
        after = managed.snapshot().queues[0]
        dups |= {
            "deliveries": after.received - snap.received,
            "reported_replays": after.transient_replays - snap.transient_replays,
            "deferrals": after.deferrals - snap.deferrals,
            "duplicates_seen": after.outcomes.get("duplicate", 0) - snap.outcomes.get("duplicate", 0),
        }
        commands.rearm("teardown")
    finally:
        report = await managed.shutdown()
        await client.close()
    if not report.succeeded:
        raise SystemExit(f"{_OUTCOME_ERROR}: lily shutdown:\n{report.render()}")
    return {"first": first, "dups": dups}


class HandStats:
    def __init__(self) -> None:
        self.deliveries = 0
        self.committed = 0
        self.duplicates = 0
        self.deferred = 0
        self.replays = 0


async def hand_commit(session: Any) -> bool:
    """True once committed; False if the commit did not apply (or stayed unknown): replay."""
    for retry in range(COMMIT_RETRIES + 1):
        try:
            await session.commit_transaction()
            return True
        except PyMongoError as exc:
            if not exc.has_error_label(UNKNOWN_COMMIT) or retry == COMMIT_RETRIES:
                break
    # A replay is safe even if the commit did apply: its inbox insert then meets the key.
    # mongoeco as it ships keeps a transaction whose commit failed open on its server session
    # and commits it with the session's next transaction (docs/emulator.md): never reuse it.
    mark_dirty = getattr(getattr(session, "_server_session", None), "mark_dirty", None)
    if callable(mark_dirty):
        mark_dirty()
    return False


async def hand_record(
    client: AsyncMongoClient[Any],
    inbox: Any,
    key: str,
    writes: Callable[[Any], Awaitable[None]],
    replayed: Callable[[], None],
) -> str:
    """The hand-written inbox: per message a session and a transaction (snapshot reads, majority
    commit) inserting the inbox key (DuplicateKeyError: a duplicate), then ``writes(session)``;
    replayed on TransientTransactionError and on a commit that did not apply, lily's budget."""
    for attempt in range(REPLAY_BUDGET + 1):
        if attempt:
            replayed()
            await asyncio.sleep(random.uniform(0, min(BACKOFF_MAX, BACKOFF_BASE * 2**attempt)))
        async with client.start_session(causal_consistency=False) as session:
            await session.start_transaction(
                read_concern=ReadConcern("snapshot"), write_concern=WriteConcern("majority")
            )
            try:
                await inbox.insert_one({"_id": key}, session=session)
                await writes(session)
            except DuplicateKeyError:
                await session.abort_transaction()
                return "duplicate"
            except PyMongoError as exc:
                await session.abort_transaction()
                if exc.has_error_label(TRANSIENT):
                    continue
                raise
            if await hand_commit(session):
                return "committed"
    return "deferred"


async def child_hand(config: dict[str, Any], commands: CommandLog) -> dict[str, Any]:
    client: AsyncMongoClient[Any] = AsyncMongoClient(
        config["mongo_uri"], event_listeners=[commands], serverSelectionTimeoutMS=10_000
    )
    database = client[config["database"]]
    inbox, orders = database[HAND_INBOX], database[BUSINESS]
    semaphore = asyncio.Semaphore(config["concurrency"])
    stats = HandStats()

    def replayed() -> None:
        stats.replays += 1

    async def record(key: str, document: dict[str, Any]) -> str:
        async def writes(session: Any) -> None:
            await orders.insert_one(document, session=session)

        return await hand_record(client, inbox, key, writes, replayed)

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        async with semaphore:
            stats.deliveries += 1
            try:
                event_id = str(message.headers[EVENT_ID_HEADER])
                order = Order.model_validate_json(message.body)
                verdict = await record(f"{HAND_HANDLER}|{event_id}", business_document(event_id, order))
            except Exception:
                log.exception("hand-written handler failed")
                verdict = "deferred"
            if verdict == "deferred":
                stats.deferred += 1
                await message.nack(requeue=True)
                return
            await message.ack()
            if verdict == "duplicate":
                stats.duplicates += 1
            else:
                stats.committed += 1

    connection = await aio_pika.connect_robust(config["amqp_url"])
    try:
        channel = await connection.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=config["prefetch"])
        declared = await channel.declare_queue(config["queue"], passive=True)
        await declared.consume(on_message, no_ack=False)
        phases = Phases(commands, lambda: stats.committed + stats.duplicates, config["timeout"])
        first = await phases.run(config["messages"], config["messages"])
        first |= {"deliveries": stats.deliveries, "reported_replays": stats.replays, "deferrals": stats.deferred}
        seen = (stats.deliveries, stats.replays, stats.deferred, stats.duplicates)
        commands.rearm("dups")
        announce(phase="first_done")
        dups = await phases.run(config["messages"] + config["duplicates"], config["duplicates"])
        dups |= {
            "deliveries": stats.deliveries - seen[0],
            "reported_replays": stats.replays - seen[1],
            "deferrals": stats.deferred - seen[2],
            "duplicates_seen": stats.duplicates - seen[3],
        }
        commands.rearm("teardown")
    finally:
        await connection.close()
        await client.close()
    return {"first": first, "dups": dups}


async def ledger(config: dict[str, Any]) -> dict[str, int]:
    """The business writes, read on a client of its own: one per event expected."""
    client: AsyncMongoClient[Any] = AsyncMongoClient(config["mongo_uri"], serverSelectionTimeoutMS=10_000)
    try:
        ids = [doc["event_id"] async for doc in client[config["database"]][BUSINESS].find({}, {"event_id": 1})]
    finally:
        await client.close()
    return {"documents": len(ids), "events": len(set(ids))}


async def child(config: dict[str, Any]) -> int:
    commands = CommandLog()
    run = child_lily if config["kind"] == "lily" else child_hand
    figures = await asyncio.wait_for(run(config, commands), timeout=3 * config["timeout"])
    announce(result=figures | {"commands": analyse(commands), "ledger": await ledger(config)})
    return 0


# -- the parent ------------------------------------------------------------------------------------


class EmbeddedServer:
    """``python -m lily_mongo.embedded`` on a free loopback port, for the whole benchmark."""

    def __init__(self, *, majority_latency_ms: float = 0) -> None:
        self.process: asyncio.subprocess.Process | None = None
        self.flags = ["--majority-latency-ms", f"{majority_latency_ms:g}"] if majority_latency_ms else []

    async def start(self) -> str:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "lily_mongo.embedded", "--port", "0", *self.flags, stdout=asyncio.subprocess.PIPE
        )
        assert self.process.stdout is not None
        line = (await asyncio.wait_for(self.process.stdout.readline(), timeout=60)).decode()
        if not line.startswith("READY "):
            raise SystemExit(f"the embedded MongoDB-wire server did not start: {line!r}")
        return line.split(None, 1)[1].strip()

    async def stop(self) -> None:
        if self.process is None or self.process.returncode is not None:
            return
        self.process.terminate()
        try:
            await asyncio.wait_for(self.process.wait(), timeout=10)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()


async def declare(connection: aio_pika.abc.AbstractConnection, options: QueueOptions) -> None:
    """The queue and its DLQ, with the arguments lily would declare; both contenders consume it passively."""
    channel = await connection.channel()
    try:
        await channel.declare_queue(options.dlq_name, durable=True)
        await channel.declare_queue(
            options.name,
            durable=True,
            arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": options.dlq_name},
        )
    finally:
        await channel.close()


async def depth(connection: aio_pika.abc.AbstractConnection, name: str) -> int:
    channel = await connection.channel()
    try:
        declared = await channel.declare_queue(name, passive=True)
        return int(declared.declaration_result.message_count or 0)
    finally:
        await channel.close()


async def publish(url: str, name: str, messages: list[tuple[str, dict[str, Any]]]) -> None:
    async with Publisher(url) as publisher:
        for start in range(0, len(messages), PUBLISH_BATCH):
            await asyncio.gather(
                *(
                    publisher.publish_json(name, payload, version=1, event_id=event_id)
                    for event_id, payload in messages[start : start + PUBLISH_BATCH]
                )
            )


async def read_line(process: asyncio.subprocess.Process, deadline: float) -> dict[str, Any]:
    assert process.stdout is not None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        line = await asyncio.wait_for(process.stdout.readline(), timeout=remaining)
        if not line:
            raise SystemExit(f"a child ended without its figures (exit status {await process.wait()})")
        try:
            message: dict[str, Any] = json.loads(line)
        except ValueError:
            print(line.decode(errors="replace").rstrip(), file=sys.stderr)
            continue
        return message


async def run_child(
    args: argparse.Namespace, connection: aio_pika.abc.AbstractConnection, kind: str, concurrency: int, round_: int
) -> dict[str, Any]:
    """One contender in a fresh process on a fresh queue and a fresh database."""
    tag = uuid.uuid4().hex[:10]
    options = QueueOptions(name=f"bench.inbox.{tag}", concurrency=concurrency, prefetch=args.prefetch)
    duplicates = round(args.messages * args.duplicates)
    config = {
        "kind": kind,
        "mongo_uri": args.mongo_uri,
        "amqp_url": args.amqp_url,
        "queue": options.name,
        "database": f"bench_inbox_{tag}",
        "messages": args.messages,
        "duplicates": duplicates,
        "concurrency": concurrency,
        "prefetch": options.effective_prefetch,
        "relay": args.relay,
        "lease_first": args.lease_first,
        "timeout": args.timeout,
    }
    rng = random.Random(f"{round_}")
    messages = [
        (str(uuid.uuid4()), {"order_id": f"order-{round_}-{i}", "amount": rng.randint(1, 100_000)})
        for i in range(args.messages)
    ]
    await declare(connection, options)
    try:
        await publish(args.amqp_url, options.name, messages)
        if (ready := await depth(connection, options.name)) != args.messages:
            raise SystemExit(f"the queue holds {ready} messages after publishing {args.messages}")
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(SCRIPT), "--child", json.dumps(config), stdout=asyncio.subprocess.PIPE
        )
        deadline = time.monotonic() + 3 * args.timeout + 60
        try:
            signal = await read_line(process, deadline)
            if signal.get("phase") != "first_done":
                raise SystemExit(f"unexpected message from a child: {signal}")
            await publish(args.amqp_url, options.name, rng.sample(messages, duplicates))
            figures: dict[str, Any] = (await read_line(process, deadline))["result"]
            status = await asyncio.wait_for(process.wait(), timeout=max(deadline - time.monotonic(), 1))
        except BaseException:
            if process.returncode is None:
                process.kill()
                await process.wait()
            raise
        if status != 0:
            raise SystemExit(f"a {kind} child exited with status {status}")
        left = await depth(connection, options.name) + await depth(connection, options.dlq_name)
        if left:
            raise SystemExit(f"{left} messages left in the queue or its DLQ after a {kind} run")
    finally:
        channel = await connection.channel()
        for name in (options.name, options.dlq_name):
            await channel.queue_delete(name)
        await channel.close()
        client: AsyncMongoClient[Any] = AsyncMongoClient(args.mongo_uri, serverSelectionTimeoutMS=10_000)
        try:
            await client.drop_database(config["database"])
        finally:
            await client.close()
    figures |= {"kind": kind, "concurrency": concurrency, "round": round_, "messages": args.messages}
    book = figures["ledger"]
    if book["documents"] != args.messages or book["events"] != args.messages:
        raise SystemExit(f"{kind}: {book} business documents for {args.messages} events (effects not once)")
    return figures


# -- summary ---------------------------------------------------------------------------------------


def per(counts: Mapping[str, float], divisor: float) -> dict[str, float]:
    return {name: value / divisor for name, value in counts.items()} if divisor else {}


def pooled(runs: list[dict[str, Any]], phase: str) -> dict[str, Any]:
    """Command profiles pooled over the runs of one contender at one concurrency."""
    clean: collections.Counter[str] = collections.Counter()
    clean_failed: collections.Counter[str] = collections.Counter()
    replayed: collections.Counter[str] = collections.Counter()
    failed: collections.Counter[str] = collections.Counter()
    micros: collections.Counter[str] = collections.Counter()
    clean_events = replays = replayed_events = events = 0
    for run in runs:
        profile = run["commands"][phase]
        micros.update(profile["micros"])
        clean.update(profile["clean"])
        clean_failed.update(profile["clean_failed"])
        replayed.update(profile["replayed_totals"])
        failed.update(profile["failed"])
        clean_events += profile["clean_events"]
        replays += profile["replays"]
        replayed_events += profile["replayed_events"]
        events += profile["events"]
    base = per(clean, clean_events)
    extra = {name: replayed.get(name, 0) - base.get(name, 0) * replayed_events for name in set(replayed) | set(base)}
    return {
        "events": events,
        "clean_events": clean_events,
        "per_delivery": base,
        "failed_per_delivery": per(clean_failed, clean_events),
        "replays": replays,
        "replays_per_event": replays / events if events else 0.0,
        "extra_per_replay": {k: v for k, v in per(extra, replays).items() if abs(v) > 1e-9},
        "failed_total": dict(failed),
        "round_trip_ms": {
            name: micros[name] / micros[f"{name} n"] / 1000 for name in micros if not name.endswith(" n")
        },
    }


def describe(counts: Mapping[str, float], failed: Mapping[str, float] | None = None) -> str:
    if not counts:
        return "-"
    parts = []
    for name, value in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        fails = [f"{v:.2f} {k.split(' ', 1)[1]}" for k, v in (failed or {}).items() if k.split(" ", 1)[0] == name]
        parts.append(f"{name} {value:.2f}" + (f" (failed: {', '.join(fails)})" if fails else ""))
    return f"{sum(counts.values()):5.2f} = " + ", ".join(parts)


def summarise(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for concurrency in args.concurrency:
        entry: dict[str, Any] = {}
        for kind in KINDS:
            mine = [r for r in runs if r["kind"] == kind and r["concurrency"] == concurrency]
            entry[kind] = {
                "msgs_per_s": statistics.median(args.messages / r["first"]["seconds"] for r in mine),
                "cpu_us_per_msg": statistics.median(r["first"]["cpu"] / args.messages * 1e6 for r in mine),
                "cpu_sys_us_per_msg": statistics.median(r["first"]["cpu_sys"] / args.messages * 1e6 for r in mine),
                "cpu_us_per_duplicate": statistics.median(
                    r["dups"]["cpu"] / max(r["dups"]["deliveries"], 1) * 1e6 for r in mine
                ),
                "replays_per_msg": statistics.median(r["commands"]["first"]["replays"] / args.messages for r in mine),
                "reported_replays": sum(r["first"]["reported_replays"] for r in mine),
                "deliveries_per_msg": statistics.median(r["first"]["deliveries"] / args.messages for r in mine),
                "first_time": pooled(mine, "first"),
                "duplicates": pooled(mine, "dups"),
                "not_charged_per_run": {
                    phase: per(counts, len(mine))
                    for phase, counts in _sum_phases(r["commands"]["not_charged"] for r in mine).items()
                },
            }
        ratios = []
        for round_ in range(1, args.rounds + 1):
            rate = {
                r["kind"]: args.messages / r["first"]["seconds"]
                for r in runs
                if r["round"] == round_ and r["concurrency"] == concurrency
            }
            if len(rate) == 2:
                ratios.append(rate["lily"] / rate["hand"])
        entry["ratios"] = ratios
        entry["ratio"] = statistics.median(ratios) if ratios else None
        summary[str(concurrency)] = entry
    return summary


def _sum_phases(items: Any) -> dict[str, collections.Counter[str]]:
    total: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for item in items:
        for phase, counts in item.items():
            total[phase].update(counts)
    return total


def print_summary(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    print()
    print("throughput from the first delivery to the last ACK (median of rounds); consumer process CPU")
    print("(user + system, of which system) over the same window; replays and deliveries per message")
    header = (
        f"{'conc':>4}  {'contender':<34} {'msgs/s':>7} {'CPU us/msg':>10} {'(system)':>9} {'CPU us/dup':>10} "
        f"{'replays/msg':>11} {'deliveries/msg':>14}"
    )
    print(header)
    print("-" * len(header))
    for concurrency, entry in summary.items():
        for kind in KINDS:
            e = entry[kind]
            print(
                f"{concurrency:>4}  {LABELS[kind]:<34} {e['msgs_per_s']:7.1f} {e['cpu_us_per_msg']:10.0f} "
                f"{e['cpu_sys_us_per_msg']:9.0f} {e['cpu_us_per_duplicate']:10.0f} {e['replays_per_msg']:11.3f} "
                f"{e['deliveries_per_msg']:14.3f}"
            )
        ratios = entry["ratios"]
        if ratios:
            cpu = entry["lily"]["cpu_us_per_msg"] / entry["hand"]["cpu_us_per_msg"]
            print(
                f"{'':>4}  ratio lily/hand msgs/s: median {entry['ratio']:.2f} over {len(ratios)} rounds "
                f"(per round: {' '.join(f'{r:.2f}' for r in ratios)}; spread {min(ratios):.2f}-{max(ratios):.2f}); "
                f"CPU per message lily/hand {cpu:.2f}"
            )
    print()
    print("MongoDB commands per delivery by command name: the consumer's own client (CommandListener), pooled over")
    print("rounds. A replay is one more transaction started for an event (a redelivery after a deferral included).")
    print("Commands naming no event are listed as not charged; PyMongo reports its server monitoring (hello) to")
    print("server listeners, not to command listeners, so it appears nowhere.")
    for concurrency, entry in summary.items():
        for kind in KINDS:
            e = entry[kind]
            first, dups = e["first_time"], e["duplicates"]
            own = "lily's snapshot" if kind == "lily" else "its own count"
            print(f"  concurrency {concurrency}, {LABELS[kind]}:")
            print(
                f"    first-time, no replay ({first['clean_events']} of {first['events']}): "
                f"{describe(first['per_delivery'], first['failed_per_delivery'])}"
            )
            print(
                f"    duplicate, no replay ({dups['clean_events']} of {dups['events']}): "
                f"{describe(dups['per_delivery'], dups['failed_per_delivery'])}"
            )
            print(
                f"    replays: {first['replays']} among {first['events']} first-time messages "
                f"({first['replays_per_event']:.3f} per message; {own}: {e['reported_replays']}), "
                f"{dups['replays']} among duplicates"
            )
            if kind == "lily" and first["per_delivery"]:
                spent = sum(first["per_delivery"].values())
                duplicate = sum(dups["per_delivery"].values())
                # The duplicates here are copies delivered for the first time (published twice):
                # claimed in the transaction they cost the claim and its read-only commit; a redelivered
                # copy takes the lease claim, 1 command (tests/integration/test_inbox_budget.py).
                first_bound, dup_bound = (3 + 1, 1) if args.lease_first else (2 + 1, 2)
                path = "lease claim first" if args.lease_first else "first-time copies claim in the transaction"
                print(
                    f"    budget ({path}; k = 1 handler write): first-time <= {first_bound}, duplicate <= "
                    f"{dup_bound}; measured {spent:.2f} ({'within' if spent <= first_bound + 1e-9 else 'OVER'}) and "
                    f"{duplicate:.2f} ({'within' if duplicate <= dup_bound + 1e-9 else 'OVER'})"
                )
            if first["replays"]:
                print(f"    extra commands per replay: {describe(first['extra_per_replay'])}")
            if first["failed_total"]:
                failed = ", ".join(f"{k} x{v}" for k, v in sorted(first["failed_total"].items()))
                print(f"    failed commands among first-time deliveries (all rounds): {failed}")
            trips = ", ".join(f"{k} {v:.2f}" for k, v in sorted(first["round_trip_ms"].items()))
            print(f"    mean round trip, ms: {trips}")
            for phase, counts in e["not_charged_per_run"].items():
                if counts:
                    listed = ", ".join(f"{k} x{v:g}" for k, v in sorted(counts.items()))
                    print(f"    not charged ({PHASE_NAMES.get(phase, phase)}, per run): {listed}")


async def parent(args: argparse.Namespace) -> int:
    out = sys.stderr if args.json else sys.stdout
    server = None
    args.amqp_url = os.environ.get("LILY_AMQP_URL", DEFAULT_AMQP_URL)
    args.mongo_uri = os.environ.get("LILY_MONGO_URI")
    backend = "MongoDB from LILY_MONGO_URI"
    if not args.mongo_uri:
        server = EmbeddedServer()
        args.mongo_uri = await server.start()
        backend = "the embedded MongoDB-wire emulator (mongoeco)"
    runs: list[dict[str, Any]] = []
    try:
        connection = await aio_pika.connect(args.amqp_url)
        try:
            print(
                f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs; {backend}; "
                f"{args.messages} messages per run, then {round(args.messages * args.duplicates)} duplicate copies; "
                f"{args.rounds} rounds (order alternating); concurrency {' '.join(map(str, args.concurrency))}; "
                f"prefetch {args.prefetch}; lily outbox relay "
                f"{'on (its commands listed as not charged)' if args.relay else 'off (OutboxOptions(run_relay=False))'}"
                f"; lily claims {'with the lease first' if args.lease_first else 'first copies in the transaction'}",
                file=out,
            )
            for round_ in range(1, args.rounds + 1):
                for concurrency in args.concurrency:
                    for kind in KINDS if round_ % 2 else KINDS[::-1]:
                        run = await run_child(args, connection, kind, concurrency, round_)
                        runs.append(run)
                        first, dups = run["commands"]["first"], run["commands"]["dups"]
                        if first["events"] != args.messages or dups["events"] != run["dups"]["duplicates_seen"]:
                            print(
                                f"WARNING: commands named {first['events']} + {dups['events']} events, expected "
                                f"{args.messages} + {run['dups']['duplicates_seen']}: the per-delivery figures "
                                "below are not complete (see the not-charged lists)",
                                file=out,
                            )
                        print(
                            f"round {round_} c={concurrency} {kind:<4}: "
                            f"{args.messages / run['first']['seconds']:6.0f} msgs/s, "
                            f"CPU {run['first']['cpu'] / args.messages * 1e6:6.0f} us/msg, "
                            f"commands/msg {sum(first['totals'].values()) / args.messages:.2f}, "
                            f"replays/msg {first['replays'] / args.messages:.3f}, "
                            f"commands/dup {sum(dups['totals'].values()) / max(dups['events'], 1):.2f}",
                            file=out,
                        )
        finally:
            await connection.close()
    finally:
        if server is not None:
            await server.stop()
    summary = summarise(args, runs)
    if args.json:
        config = {
            key: getattr(args, key)
            for key in (
                "messages",
                "rounds",
                "concurrency",
                "duplicates",
                "prefetch",
                "relay",
                "lease_first",
                "timeout",
            )
        }
        print(json.dumps({"backend": backend, "config": config, "summary": summary, "runs": runs}, indent=1))
    else:
        print_summary(args, summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=400, help="first-time messages per run (default 400)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of one run per contender (default 5)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4], help="handler concurrency (default 1 4)")
    parser.add_argument(
        "--duplicates", type=float, default=0.1, help="second copies, a fraction of the messages (default 0.1)"
    )
    parser.add_argument("--prefetch", type=int, default=64, help="prefetch for both consumers (default 64)")
    parser.add_argument("--relay", action="store_true", help="run lily's outbox relay (default off)")
    parser.add_argument(
        "--lease-first",
        action="store_true",
        help="every copy takes the lease claim first (InboxOptions(claim_in_transaction=False))",
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds per phase (default 60 + messages/4)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON (progress on stderr)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.child:
        return asyncio.run(child(json.loads(args.child)))
    if args.messages < 1 or args.rounds < 1 or not 0 <= args.duplicates <= 1 or min(args.concurrency) < 1:
        parser.error("--messages, --rounds and --concurrency must be >= 1, --duplicates within 0..1")
    args.timeout = args.timeout or 60 + args.messages / 4
    return asyncio.run(parent(args))


if __name__ == "__main__":
    raise SystemExit(main())
