"""The outbox: draining a backlog, the pipeline with and without an outbox message, and the lag from commit to arrival.

Run: ``python benchmarks/bench_outbox.py [--drain 1000] [--messages 400] [--rounds 5]
[--concurrency 1 4] [--lag-rate 40] [--lag-messages 400] [--parts drain pipeline lag] [--json]``
(``LILY_MONGO_URI`` selects MongoDB, a replica set; unset, the embedded MongoDB-wire
emulator is started for the run. ``LILY_AMQP_URL`` selects the broker; default the
local RabbitMQ as guest.)

(a) **drain**: ``--drain`` outbox records (unclaimed, as ``Outbox.transaction``
    without ``amqp_url`` writes them) are inserted into a fresh collection; a
    child process runs ``lily_mongo.Relay`` with the default ``OutboxOptions`` and
    is timed from its start to its last mark. Records/s, and the MongoDB commands
    the outbox collection received per record (CommandListener on the relay's client).
(b) **pipeline**: N messages are published to a queue; a child process consumes
    them with an inbox handler that makes one business insert and, for the outbox
    contenders, stages one message to a destination queue. Contenders, each in its
    own fresh process, fresh queues and a fresh database, rounds alternating:

    * ``lily``: ``mongo.outbox.publish_json(...)`` in the handler (default options:
      dispatch after commit, the backstop relay running);
    * ``plain``: the same handler without the outbox message;
    * ``hand``: what a competent user writes with aio-pika and PyMongo: per message a
      session and a transaction (snapshot read concern, majority write concern)
      inserting the inbox key (DuplicateKeyError → duplicate), the business document
      and an outbox record; commit (replayed on ``TransientTransactionError`` and on
      a commit error without ``UnknownTransactionCommitResult``, the same budget as
      lily's); then publish the message mandatory on a confirming channel and wait
      for its confirm, mark the record published (majority), ACK. It has no
      backstop relay: a crash after its commit leaves the record unpublished.

    Timed from the first delivery (the child's first MongoDB command naming an event)
    to the last message's arrival at the destination queue (consumed by the parent,
    which notes arrival times), or, for ``plain``, to the last ACK. CPU is the child's
    (user + system) over the same window. The ratios are medians of per-round ratios.
    Commands the outbox collection received per record are counted in the child. With
    the embedded emulator, its process's CPU per message over the child's run is
    printed too: it serves one command at a time, so that figure bounds throughput.
(c) **lag**: messages are published at a steady ``--lag-rate`` (below saturation) to
    a ``lily`` (and a ``hand``) child at concurrency 4; the lag of each event is its
    arrival at the destination minus its transaction's commit (the child's
    ``commitTransaction`` reply, CommandListener; both clocks are this machine's).

mongoeco as it ships fails every transaction open at any write anywhere: there the
dispatcher's batched marks, the hand peer's per-record marks and the relay's claims
made concurrent transactions replay, which MongoDB does not do; the embedded server
conflicts per document as MongoDB does (docs/emulator.md). Replays are reported per
contender; no default is tuned to the emulator.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import logging
import os
import platform
import random
import statistics
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aio_pika
import aio_pika.abc
import orjson
import pydantic
from pymongo import AsyncMongoClient, monitoring
from pymongo.write_concern import WriteConcern

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_inbox import (
    _UUID,
    BUSINESS,
    DEFAULT_AMQP_URL,
    EVENT_ID_HEADER,
    HAND_HANDLER,
    HAND_INBOX,
    EmbeddedServer,
    cpu_times,
    hand_record,
    read_line,
)
from lily_mongo import (
    Consumer,
    EventId,
    Json,
    MongoScope,
    Publisher,
    QueueOptions,
    Relay,
    RetryPolicy,
    queue,
)
from lily_mongo._outbox.protocol import new_record
from lily_mongo.publisher import JSON, prepare_publication

SCRIPT = Path(__file__).resolve()
OUTBOX = "lily_outbox"
HAND_OUTBOX = "bench_hand_outbox"  # the hand-written peer's; its inbox and business names are bench_inbox's
POLL = 0.01  # how often a child checks its counts (the same for every contender; 1% of a 1 s run)
PUBLISH_BATCH = 100
PIPELINE = ("lily", "plain", "hand")
LABELS = {
    "lily": "lily_mongo, one outbox message per event",
    "plain": "lily_mongo, no outbox message",
    "hand": "hand-written outbox (aio-pika + PyMongo)",
}
_OUTCOME_ERROR = "RUN FAILED"

log = logging.getLogger("bench_outbox")


class Order(pydantic.BaseModel):
    order_id: str
    amount: int


# -- the child's command stream ---------------------------------------------------------------------


class Commands(monitoring.CommandListener):
    """The child's own client: the first command naming an event (the phase's start), the commands the
    outbox collections received by name, and (``lag``) each event's commit time."""

    def __init__(self, *, lag: bool, drain: bool = False) -> None:
        self.lag = lag
        self.drain = drain
        self.first: tuple[float, float, float] | None = None  # wall time, user and system CPU
        self.outbox: collections.Counter[str] = collections.Counter()
        self.counting = True
        self._txn_event: dict[tuple[bytes, int], str] = {}
        self._commit_txn: dict[int, tuple[bytes, int]] = {}
        self.committed: dict[str, float] = {}

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        command, name = event.command, event.command_name
        target = command.get(name)
        if self.first is None and name in ("findAndModify", "insert", "update", "find") and target != HAND_OUTBOX:
            # The first delivery's first command names its event; a relay's first claim is its first find.
            first_claim = self.drain and name == "find" and target == OUTBOX
            if first_claim or (not self.drain and target != OUTBOX and _names_event(command)):
                self.first = (time.time(), *cpu_times())
        if self.counting and target in (OUTBOX, HAND_OUTBOX) and name != "createIndexes":  # set-up, once
            self.outbox[name] += 1
        if not self.lag:
            return
        lsid = command.get("lsid")
        if lsid is None or "txnNumber" not in command:
            return
        txn = (bytes(lsid["id"]), int(command["txnNumber"]))
        if name == "insert" and target == BUSINESS:
            self._txn_event[txn] = str(command["documents"][0]["event_id"])
        elif name == "commitTransaction":
            self._commit_txn[event.request_id] = txn

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        txn = self._commit_txn.pop(event.request_id, None)
        if txn is not None and txn in self._txn_event:
            self.committed[self._txn_event[txn]] = time.time()

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        self._commit_txn.pop(event.request_id, None)


def _names_event(command: Mapping[str, Any]) -> bool:
    return _UUID.search(repr(command)) is not None


def announce(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


async def stdin_line() -> str:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, sys.stdin.readline)


def business_document(event_id: str, order: Order) -> dict[str, Any]:
    return {"event_id": event_id, "order_id": order.order_id, "amount": order.amount}


def outgoing(event_id: str, order: Order) -> dict[str, Any]:
    return {"order_id": order.order_id, "source": event_id}


# -- the contenders (each runs in a child process) ------------------------------------------------------


async def wait_for(done: Any, target: int, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while done() < target:
        if time.monotonic() > deadline:
            raise SystemExit(f"{_OUTCOME_ERROR}: {done()} of {target} deliveries finished in {timeout} s")
        await asyncio.sleep(POLL)
    return time.time()


async def child_lily(config: dict[str, Any], commands: Commands) -> dict[str, Any]:
    name, down, with_outbox = config["queue"], config["down"], config["kind"] == "lily"

    @queue(name, version=1, content="json")
    async def record_order(order: Json[Order], event_id: EventId, mongo: MongoScope) -> None:
        await mongo.database[BUSINESS].insert_one(business_document(str(event_id), order), session=mongo.session)
        if with_outbox:
            await mongo.outbox.publish_json(down, outgoing(str(event_id), order), version=1)

    client: AsyncMongoClient[Any] = AsyncMongoClient(
        config["mongo_uri"], event_listeners=[commands], serverSelectionTimeoutMS=10_000
    )
    consumer = Consumer(
        amqp_url=config["amqp_url"],
        name="bench-outbox",
        mongo_client=client,
        database=config["database"],
        telemetry=False,
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

    def done() -> int:
        counts = managed.snapshot().queues[0].outcomes
        unexpected = {k: v for k, v in counts.items() if k not in ("acked", "duplicate", "deferred") and v}
        if unexpected:
            raise SystemExit(f"{_OUTCOME_ERROR}: unexpected outcomes {unexpected}")
        return counts.get("acked", 0) + counts.get("duplicate", 0)

    try:
        announce(phase="ready")
        acked = await wait_for(done, config["messages"], config["timeout"])
        announce(phase="acked", at=acked)
        await stdin_line()
        ended = cpu_times()
        commands.counting = False
        snap = managed.snapshot().queues[0]
        figures = {"replays": snap.transient_replays, "deferrals": snap.deferrals, "deliveries": snap.received}
    finally:
        report = await managed.shutdown()
        await client.close()
    if not report.succeeded:
        raise SystemExit(f"{_OUTCOME_ERROR}: lily shutdown:\n{report.render()}")
    return figures | _window(commands, ended)


def _window(commands: Commands, ended: tuple[float, float]) -> dict[str, Any]:
    if commands.first is None:
        raise SystemExit(f"{_OUTCOME_ERROR}: no command named an event")
    _, user, system = commands.first
    return {
        "first_at": commands.first[0],
        "cpu": ended[0] - user + ended[1] - system,
        "outbox_commands": dict(commands.outbox),
        "committed": commands.committed,
    }


async def child_hand(config: dict[str, Any], commands: Commands) -> dict[str, Any]:
    client: AsyncMongoClient[Any] = AsyncMongoClient(
        config["mongo_uri"], event_listeners=[commands], serverSelectionTimeoutMS=10_000
    )
    database = client[config["database"]]
    inbox, orders, outbox = database[HAND_INBOX], database[BUSINESS], database[HAND_OUTBOX]
    marks = outbox.with_options(write_concern=WriteConcern("majority"))
    semaphore = asyncio.Semaphore(config["concurrency"])
    down = config["down"]
    counts = collections.Counter[str]()

    def replayed() -> None:
        counts["replays"] += 1

    async def record(key: str, document: dict[str, Any], message: dict[str, Any]) -> str:
        async def writes(session: Any) -> None:
            await orders.insert_one(document, session=session)
            await outbox.insert_one(message, session=session)

        return await hand_record(client, inbox, key, writes, replayed)

    connection = await aio_pika.connect_robust(config["amqp_url"])
    publishing = await connection.channel(publisher_confirms=True, on_return_raises=True)

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        async with semaphore:
            try:
                event_id = str(message.headers[EVENT_ID_HEADER])
                order = Order.model_validate_json(message.body)
                body = orjson.dumps(outgoing(event_id, order))
                headers: aio_pika.abc.HeadersType = {
                    EVENT_ID_HEADER: str(uuid.uuid4()),
                    "x-lily-schema-version": "1",
                    "x-lily-content-kind": "json",
                }
                row = {
                    "_id": uuid.uuid4().hex,
                    "routing_key": down,
                    "body": body,
                    "headers": headers,
                    "status": "pending",
                }
                verdict = await record(f"{HAND_HANDLER}|{event_id}", business_document(event_id, order), row)
                if verdict == "committed":
                    # Publish after the commit, wait for its confirm, then mark the record published.
                    await publishing.default_exchange.publish(
                        aio_pika.Message(
                            body,
                            headers=headers,
                            content_type="application/json",
                            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                        ),
                        routing_key=down,
                        mandatory=True,
                    )
                    await marks.update_one({"_id": row["_id"]}, {"$set": {"status": "published"}})
            except Exception:
                log.exception("hand-written handler failed")
                verdict = "deferred"
            if verdict == "deferred":
                counts["deferrals"] += 1
                await message.nack(requeue=True)
                return
            await message.ack()
            counts["done"] += 1

    try:
        channel = await connection.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=config["prefetch"])
        declared = await channel.declare_queue(config["queue"], passive=True)
        await declared.consume(on_message, no_ack=False)
        announce(phase="ready")
        acked = await wait_for(lambda: counts["done"], config["messages"], config["timeout"])
        announce(phase="acked", at=acked)
        await stdin_line()
        ended = cpu_times()
        commands.counting = False
    finally:
        await connection.close()
        await client.close()
    return {"replays": counts["replays"], "deferrals": counts["deferrals"]} | _window(commands, ended)


async def child_drain(config: dict[str, Any], commands: Commands) -> dict[str, Any]:
    client: AsyncMongoClient[Any] = AsyncMongoClient(
        config["mongo_uri"], event_listeners=[commands], serverSelectionTimeoutMS=10_000
    )
    relay = Relay(client, config["database"], amqp_url=config["amqp_url"], name="bench-drain", telemetry=False)
    total = config["messages"]
    try:
        await relay.start()
        ended = await wait_for(lambda: relay.snapshot().outbox_published, total, config["timeout"])
        cpu_end = cpu_times()
        commands.counting = False
    finally:
        report = await relay.shutdown()
        await client.close()
    if not report.succeeded:
        raise SystemExit(f"{_OUTCOME_ERROR}: relay shutdown:\n{report.render()}")
    if commands.first is None:
        raise SystemExit(f"{_OUTCOME_ERROR}: the relay never claimed")
    started, user, system = commands.first
    return {
        "seconds": ended - started,
        "cpu": cpu_end[0] - user + cpu_end[1] - system,
        "outbox_commands": dict(commands.outbox),
    }


async def child(config: dict[str, Any]) -> int:
    commands = Commands(lag=config.get("lag", False), drain=config["kind"] == "drain")
    run = {"drain": child_drain, "hand": child_hand}.get(config["kind"], child_lily)
    figures = await asyncio.wait_for(run(config, commands), timeout=3 * config["timeout"])
    announce(result=figures)
    return 0


# -- the parent -------------------------------------------------------------------------------------------


class Arrivals:
    """The destination queue, consumed by the parent: each source event's first arrival time."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.copies = 0
        self.enough = asyncio.Event()
        self.expected = 0

    async def on_message(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        at = time.time()
        source = str(orjson.loads(message.body)["source"])
        self.copies += 1
        self.first.setdefault(source, at)
        if len(self.first) >= self.expected:
            self.enough.set()


async def declare(connection: aio_pika.abc.AbstractConnection, options: QueueOptions, down: str) -> None:
    channel = await connection.channel()
    try:
        await channel.declare_queue(options.dlq_name, durable=True)
        await channel.declare_queue(
            options.name,
            durable=True,
            arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": options.dlq_name},
        )
        await channel.declare_queue(down, durable=True)
    finally:
        await channel.close()


async def drop(
    args: argparse.Namespace, connection: aio_pika.abc.AbstractConnection, names: list[str], db: str
) -> None:
    channel = await connection.channel()
    for name in names:
        await channel.queue_delete(name)
    await channel.close()
    client: AsyncMongoClient[Any] = AsyncMongoClient(args.mongo_uri, serverSelectionTimeoutMS=10_000)
    try:
        await client.drop_database(db)
    finally:
        await client.close()


async def publish(url: str, name: str, messages: list[tuple[str, dict[str, Any]]]) -> None:
    async with Publisher(url, telemetry=False) as publisher:
        for start in range(0, len(messages), PUBLISH_BATCH):
            await asyncio.gather(
                *(
                    publisher.publish_json(name, payload, version=1, event_id=event_id)
                    for event_id, payload in messages[start : start + PUBLISH_BATCH]
                )
            )


async def publish_steadily(url: str, name: str, messages: list[tuple[str, dict[str, Any]]], rate: float) -> None:
    async with Publisher(url, telemetry=False) as publisher:
        began = time.monotonic()
        for n, (event_id, payload) in enumerate(messages):
            delay = began + n / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await publisher.publish_json(name, payload, version=1, event_id=event_id)


def server_cpu(pid: int | None) -> float | None:
    """The embedded server process's user + system CPU seconds so far (Linux /proc), or None."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_child(
    args: argparse.Namespace,
    connection: aio_pika.abc.AbstractConnection,
    kind: str,
    concurrency: int,
    *,
    messages: int,
    rate: float | None = None,
) -> dict[str, Any]:
    """One pipeline contender in a fresh process, fresh queues and a fresh database."""
    tag = uuid.uuid4().hex[:10]
    options = QueueOptions(name=f"bench.outbox.{tag}", concurrency=concurrency, prefetch=args.prefetch)
    down = f"bench.outbox.{tag}.down"
    config = {
        "kind": kind,
        "amqp_url": args.amqp_url,
        "mongo_uri": args.mongo_uri,
        "database": f"bench_outbox_{tag}",
        "queue": options.name,
        "down": down,
        "messages": messages,
        "concurrency": concurrency,
        "prefetch": options.effective_prefetch,
        "timeout": args.timeout,
        "lag": rate is not None,
    }
    batch = [
        (str(uuid.uuid4()), {"order_id": f"order-{tag}-{i}", "amount": random.randint(1, 100_000)})
        for i in range(messages)
    ]
    await declare(connection, options, down)
    arrivals = Arrivals()
    arrivals.expected = messages
    channel = await connection.channel()
    try:
        if rate is None:
            await publish(args.amqp_url, options.name, batch)
        await (await channel.declare_queue(down, passive=True)).consume(arrivals.on_message, no_ack=True)
        server_before = server_cpu(args.server_pid)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(SCRIPT),
            "--child",
            json.dumps(config),
            stdout=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.PIPE,
        )
        assert process.stdin is not None
        deadline = time.monotonic() + 3 * args.timeout + 60
        try:
            if (await read_line(process, deadline)).get("phase") != "ready":
                raise SystemExit("unexpected message from a child")
            if rate is not None:
                await publish_steadily(args.amqp_url, options.name, batch, rate)
            acked = await read_line(process, deadline)
            if kind == "plain":
                ended = float(acked["at"])
            else:
                await asyncio.wait_for(arrivals.enough.wait(), timeout=max(deadline - time.monotonic(), 1))
                ended = max(arrivals.first.values())
            process.stdin.write(b"done\n")
            await process.stdin.drain()
            figures = (await read_line(process, deadline))["result"]
            server_after = server_cpu(args.server_pid)
            status = await asyncio.wait_for(process.wait(), timeout=max(deadline - time.monotonic(), 1))
        except BaseException:
            if process.returncode is None:
                process.kill()
                await process.wait()
            raise
        if status != 0:
            raise SystemExit(f"a {kind} child exited with status {status}")
    finally:
        await channel.close()
        await drop(args, connection, [options.name, options.dlq_name, down], config["database"])
    seconds = ended - figures["first_at"]
    lags = sorted(arrivals.first[e] - figures["committed"][e] for e in figures["committed"] if e in arrivals.first)
    return {
        "kind": kind,
        "concurrency": concurrency,
        "messages": messages,
        "seconds": seconds,
        "rate": messages / seconds,
        "cpu_us": figures["cpu"] / messages * 1e6,
        "server_cpu_us": None
        if server_before is None or server_after is None
        else (server_after - server_before) / messages * 1e6,
        "replays": figures["replays"],
        "deferrals": figures["deferrals"],
        "outbox_commands": figures["outbox_commands"],
        "copies": arrivals.copies,
        "lags": lags if rate is not None else [],
    }


async def run_drain(args: argparse.Namespace, connection: aio_pika.abc.AbstractConnection) -> dict[str, Any]:
    """(a) one relay process draining a backlog of ``--drain`` records."""
    tag = uuid.uuid4().hex[:10]
    database, down = f"bench_outbox_{tag}", f"bench.outbox.{tag}.down"
    channel = await connection.channel()
    await channel.declare_queue(down, durable=True)
    await channel.close()
    client: AsyncMongoClient[Any] = AsyncMongoClient(args.mongo_uri, serverSelectionTimeoutMS=10_000)
    try:
        at = datetime.datetime.now(datetime.UTC)
        records = []
        for n in range(args.drain):
            publication = prepare_publication(JSON, down, {"n": n, "source": str(n)}, version=1)
            records.append(
                new_record(
                    record_id=uuid.uuid4().hex,
                    event_id=str(publication.event_id),
                    exchange="",
                    routing_key=down,
                    body=publication.body,
                    headers=publication.headers,
                    content_type=publication.content_type,
                    writer="bench",
                    written_at=at + datetime.timedelta(milliseconds=n),
                    seq=0,
                    claim=None,
                )
            )
        for start in range(0, len(records), 100):
            await client[database][OUTBOX].insert_many(records[start : start + 100])
    finally:
        await client.close()
    config = {
        "kind": "drain",
        "amqp_url": args.amqp_url,
        "mongo_uri": args.mongo_uri,
        "database": database,
        "messages": args.drain,
        "timeout": args.timeout,
    }
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(SCRIPT), "--child", json.dumps(config), stdout=asyncio.subprocess.PIPE
        )
        figures = (await read_line(process, time.monotonic() + 3 * args.timeout + 60))["result"]
        if await process.wait() != 0:
            raise SystemExit("the drain child failed")
        channel = await connection.channel()
        depth = (await channel.declare_queue(down, passive=True)).declaration_result.message_count
        await channel.close()
        if depth != args.drain:
            raise SystemExit(f"{depth} messages arrived for {args.drain} records")
    finally:
        await drop(args, connection, [down], database)
    commands = figures["outbox_commands"]
    return {
        "records": args.drain,
        "seconds": figures["seconds"],
        "rate": args.drain / figures["seconds"],
        "cpu_us": figures["cpu"] / args.drain * 1e6,
        "commands": commands,
        "per_record": sum(commands.values()) / args.drain,
    }


# -- the summary ------------------------------------------------------------------------------------------


def _server_column(run: Mapping[str, Any]) -> str:
    server = run.get("server_cpu_us")
    return "" if server is None else f", embedded server CPU {server:6.0f} us/msg"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def describe(commands: Mapping[str, float], divisor: int) -> str:
    if not commands:
        return "-"
    parts = ", ".join(f"{k} {v / divisor:.3f}" for k, v in sorted(commands.items(), key=lambda kv: -kv[1]))
    return f"{sum(commands.values()) / divisor:.3f} = {parts}"


def _median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise_pipeline(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for concurrency in args.concurrency:
        mine = [r for r in runs if r["concurrency"] == concurrency]
        entry: dict[str, Any] = {}
        for kind in PIPELINE:
            theirs = [r for r in mine if r["kind"] == kind]
            commands: collections.Counter[str] = collections.Counter()
            for r in theirs:
                commands.update(r["outbox_commands"])
            messages = sum(r["messages"] for r in theirs)
            entry[kind] = {
                "msgs_per_s": statistics.median(r["rate"] for r in theirs),
                "cpu_us_per_msg": statistics.median(r["cpu_us"] for r in theirs),
                "server_cpu_us_per_msg": _median_or_none([r.get("server_cpu_us") for r in theirs]),
                "replays_per_msg": sum(r["replays"] for r in theirs) / messages,
                "copies_per_msg": sum(r["copies"] for r in theirs) / messages if kind != "plain" else 0.0,
                "outbox_commands": dict(commands),
                "messages": messages,
            }
        for other in ("plain", "hand"):
            ratios = []
            for round_ in sorted({r["round"] for r in mine}):
                rate = {r["kind"]: r["rate"] for r in mine if r["round"] == round_}
                if "lily" in rate and other in rate:
                    ratios.append(rate["lily"] / rate[other])
            entry[f"ratio_{other}"] = statistics.median(ratios) if ratios else None
            entry[f"ratios_{other}"] = ratios
        summary[str(concurrency)] = entry
    return summary


def print_report(args: argparse.Namespace, report: dict[str, Any]) -> None:
    drain = report.get("drain")
    if drain:
        print()
        print(
            f"(a) drain of {args.drain} records by one relay (default OutboxOptions: batches of 100), per run, "
            "from its first claim to its last mark (index set-up not counted):"
        )
        for run in drain:
            print(
                f"    {run['rate']:7.0f} records/s ({run['seconds']:.2f} s), CPU {run['cpu_us']:.0f} us/record; "
                f"outbox commands per record {describe(run['commands'], run['records'])}"
            )
        worst = max(run["per_record"] for run in drain)
        print(f"    target <= 0.1 commands per record: worst run {worst:.3f} ({'met' if worst <= 0.1 else 'MISSED'})")
    pipeline = report.get("pipeline")
    if pipeline:
        print()
        print("(b) pipeline: publish N -> inbox handler (one business insert [+ one outbox message]) -> destination;")
        print("    median msgs/s from the first delivery to the last arrival (plain: last ACK); child CPU per message")
        for concurrency, entry in pipeline.items():
            for kind in PIPELINE:
                e = entry[kind]
                print(
                    f"    c={concurrency:<2} {LABELS[kind]:<42} {e['msgs_per_s']:7.1f} msgs/s  "
                    f"CPU {e['cpu_us_per_msg']:6.0f} us/msg  replays/msg {e['replays_per_msg']:.3f}"
                    + (f"  copies/msg {e['copies_per_msg']:.3f}" if kind != "plain" else "")
                    + _server_column({"server_cpu_us": e["server_cpu_us_per_msg"]})
                )
                if kind != "plain":
                    print(f"         outbox commands per record: {describe(e['outbox_commands'], e['messages'])}")
            for other, target in (("plain", 0.8), ("hand", 1.0)):
                ratio = entry[f"ratio_{other}"]
                ratios = " ".join(f"{r:.2f}" for r in entry[f"ratios_{other}"])
                verdict = "" if ratio is None else f" (target >= {target}: {'met' if ratio >= target else 'MISSED'})"
                print(f"         lily/{other} msgs/s: median {ratio:.2f} over rounds [{ratios}]{verdict}")
    lag = report.get("lag")
    if lag:
        print()
        print(f"(c) commit-to-arrival lag at a steady {args.lag_rate:g} msgs/s, concurrency 4:")
        for kind, values in lag.items():
            print(
                f"    {LABELS[kind]:<42} p50 {percentile(values, 0.5) * 1000:7.1f} ms  "
                f"p99 {percentile(values, 0.99) * 1000:7.1f} ms  ({len(values)} events)"
            )


async def parent(args: argparse.Namespace) -> int:
    out = sys.stderr if args.json else sys.stdout
    server = None
    args.amqp_url = os.environ.get("LILY_AMQP_URL", DEFAULT_AMQP_URL)
    args.mongo_uri = os.environ.get("LILY_MONGO_URI")
    args.server_pid = None
    backend = "MongoDB from LILY_MONGO_URI"
    if not args.mongo_uri:
        server = EmbeddedServer()
        args.mongo_uri = await server.start()
        args.server_pid = server.process.pid if server.process is not None else None
        backend = "the embedded MongoDB-wire emulator (mongoeco)"
    report: dict[str, Any] = {}
    try:
        connection = await aio_pika.connect(args.amqp_url)
        try:
            print(
                f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs; {backend}; "
                f"parts {' '.join(args.parts)}",
                file=out,
            )
            if "drain" in args.parts:
                report["drain"] = []
                for round_ in range(1, args.rounds_drain + 1):
                    run = await run_drain(args, connection)
                    report["drain"].append(run)
                    print(
                        f"drain round {round_}: {run['rate']:.0f} records/s, {run['per_record']:.3f} commands/record",
                        file=out,
                    )
            if "pipeline" in args.parts:
                runs: list[dict[str, Any]] = []
                for round_ in range(1, args.rounds + 1):
                    for concurrency in args.concurrency:
                        order = PIPELINE if round_ % 2 else PIPELINE[::-1]
                        for kind in order:
                            run = await run_child(args, connection, kind, concurrency, messages=args.messages)
                            run["round"] = round_
                            runs.append(run)
                            print(
                                f"round {round_} c={concurrency} {kind:<5}: {run['rate']:6.1f} msgs/s, CPU "
                                f"{run['cpu_us']:6.0f} us/msg, replays/msg {run['replays'] / args.messages:.3f}, "
                                f"outbox commands/msg {sum(run['outbox_commands'].values()) / args.messages:.3f}"
                                + _server_column(run),
                                file=out,
                            )
                report["pipeline"] = summarise_pipeline(args, runs)
                report["pipeline_runs"] = runs
            if "lag" in args.parts:
                report["lag"] = {}
                for kind in ("lily", "hand"):
                    run = await run_child(args, connection, kind, 4, messages=args.lag_messages, rate=args.lag_rate)
                    report["lag"][kind] = run["lags"]
                    print(
                        f"lag {kind}: p50 {percentile(run['lags'], 0.5) * 1000:.1f} ms, "
                        f"p99 {percentile(run['lags'], 0.99) * 1000:.1f} ms",
                        file=out,
                    )
        finally:
            await connection.close()
    finally:
        if server is not None:
            await server.stop()
    if args.json:
        print(json.dumps({"backend": backend, "report": report}, indent=1))
    else:
        print_report(args, report)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--parts", nargs="+", choices=("drain", "pipeline", "lag"), default=["drain", "pipeline", "lag"]
    )
    parser.add_argument("--drain", type=int, default=1000, help="backlog records for (a) (default 1000)")
    parser.add_argument("--rounds-drain", type=int, default=3, help="drain runs (default 3)")
    parser.add_argument("--messages", type=int, default=400, help="messages per pipeline run (default 400)")
    parser.add_argument("--rounds", type=int, default=5, help="pipeline rounds (default 5)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4], help="handler concurrency (default 1 4)")
    parser.add_argument("--prefetch", type=int, default=64, help="prefetch (default 64)")
    parser.add_argument("--lag-rate", type=float, default=40.0, help="steady publish rate for (c), msgs/s (default 40)")
    parser.add_argument("--lag-messages", type=int, default=400, help="messages for (c) (default 400)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per phase (default 60 + messages/4)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON (progress on stderr)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.child:
        return asyncio.run(child(json.loads(args.child)))
    args.timeout = args.timeout or 60 + max(args.messages, args.drain, args.lag_messages) / 4
    return asyncio.run(parent(args))


if __name__ == "__main__":
    raise SystemExit(main())
