"""Batch handlers: events into MongoDB, many per transaction, against one per transaction and the physical limit.

Run: ``python benchmarks/bench_batch.py [--events 20000] [--rounds 3] [--sizes 10 100 500]
[--majority-latency-ms 0] [--json]``
(``LILY_MONGO_URI`` selects MongoDB, a replica set; unset, the embedded MongoDB-wire emulator is
started for the run and its CPU is read from ``/proc``. ``LILY_AMQP_URL`` selects the broker.)

Every contender consumes the same events (JSON ``{"order_id", "amount"}`` published with
``lily_mongo.Publisher``) from a queue filled before its process starts, and writes one business
document per event:

* ``batch-N``: a lily_mongo batch handler, ``BatchOptions(max_size=N)``, ``concurrency=1``,
  ``prefetch=2N``: one ``insert_many`` of the batch's documents in its transaction (the inbox
  records are the batch's own ``insert_many``);
* ``lily``: the single-event lily_mongo inbox handler (one ``insert_one`` in its transaction), the
  ``lily`` contender of ``benchmarks/bench_inbox.py``, concurrency 1;
* ``hand``: the hand-written aio-pika + PyMongo per-message inbox of ``benchmarks/bench_inbox.py``
  (a transaction per message inserting the inbox key and the document), concurrency 1;
* ``ingest``: a hand-written batch ingester with no dedup: aio-pika, batches of 100 (or 50 ms),
  one ``insert_many`` of the documents (no transaction, no inbox), then one ``basic.ack`` with
  ``multiple`` for the batch: the physical limit of this pipeline, writing half the documents.

Each run is one contender in its own fresh process, on a fresh queue and a fresh database (dropped
afterwards). The process times from its first MongoDB command that names an event to the moment
every event is settled, with its own CPU over the same window, and (emulator only) the server
process's CPU from ``/proc/<pid>/stat`` over the same window. Rounds run every contender, in an
order that alternates; each ratio is the median of its per-round paired ratios. MongoDB commands are
counted with a ``pymongo.monitoring.CommandListener`` on the consumer's own client, every command
sent during the window.

On the embedded emulator every figure is bound by the server's own CPU per document (the table
shows it), and a commit costs what any command costs; on MongoDB a commit waits for the majority,
milliseconds on a replica set, which is what a batch amortises. ``--majority-latency-ms`` models that
wait on the embedded server (docs/emulator.md). docs/handlers.md, "Batch handlers", has the figures
measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import aio_pika.abc
from pymongo import AsyncMongoClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_inbox import (  # the per-message contenders, the command log and the set-up are bench_inbox's
    BUSINESS,
    POLL,
    CommandLog,
    EmbeddedServer,
    Order,
    business_document,
    child_hand,
    child_lily,
    cpu_times,
    declare,
    depth,
    publish,
)
from lily_mongo import (
    Batch,
    BatchOptions,
    Consumer,
    Json,
    MongoScope,
    OutboxOptions,
    QueueOptions,
    RetryPolicy,
    queue,
)

SCRIPT = Path(__file__).resolve()
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
EVENT_ID_HEADER = "x-lily-event-id"
INGEST_BATCH = 100
INGEST_WAIT = 0.05
_TICKS = os.sysconf("SC_CLK_TCK")


def server_cpu(pid: int | None) -> float:
    """User + system CPU seconds of the embedded server process so far (0 when there is none to read)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


class Window:
    """Wall, consumer CPU and server CPU from the first command naming an event to the end."""

    def __init__(self, commands: CommandLog, server: int | None) -> None:
        self.commands = commands
        self.server = server
        self.server_start = server_cpu(server)
        self.sent_before = 0

    def arm(self) -> None:
        self.server_start = server_cpu(self.server)
        self.sent_before = len(self.commands.commands)

    async def until(self, done: Any, target: int, timeout: float) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while done() < target:
            if time.monotonic() > deadline:
                raise SystemExit(f"RUN FAILED: {done()} of {target} events settled in {timeout:.0f} s")
            await asyncio.sleep(POLL)
        end, user, system = time.perf_counter(), *cpu_times()
        mark = self.commands.mark
        if mark is None:
            raise SystemExit("RUN FAILED: no command named an event")
        return {
            "seconds": end - mark[0],
            "cpu": (user - mark[1]) + (system - mark[2]),
            "server_cpu": server_cpu(self.server) - self.server_start,
            "commands": len(self.commands.commands) - self.sent_before,
        }


async def child_batch(config: dict[str, Any], commands: CommandLog) -> dict[str, Any]:
    name, size = config["queue"], config["size"]

    @queue(name, version=1, batch=BatchOptions(max_size=size, max_wait=0.05))
    async def record_orders(items: Batch[Json[Order]], mongo: MongoScope) -> None:
        await mongo.database[BUSINESS].insert_many(
            [business_document(str(e.event_id), e.body) for e in items], session=mongo.session
        )

    client: AsyncMongoClient[Any] = AsyncMongoClient(config["mongo_uri"], event_listeners=[commands])
    consumer = Consumer(
        amqp_url=config["amqp_url"],
        name="bench-batch",
        mongo_client=client,
        database=config["database"],
        outbox=OutboxOptions(run_relay=False),
    )
    consumer.configure_queue(
        name, concurrency=1, prefetch=min(2 * size, 4096), retry=RetryPolicy(max_retries=0, delays=()), passive=True
    )
    consumer.include(record_orders)
    window = Window(commands, config["server_pid"])
    managed = await consumer.start()
    window.arm()

    def done() -> int:
        outcomes = managed.snapshot().queues[0].outcomes
        return outcomes.get("acked", 0) + outcomes.get("duplicate", 0)

    try:
        figures = await window.until(done, config["messages"], config["timeout"])
        queue_snapshot = managed.snapshot().queues[0]
        codes: dict[str, int] = {}
        for o in managed.delivery_terminal_observations():
            if o.outcome != "acked":
                codes[f"{o.outcome} {o.code}"] = codes.get(f"{o.outcome} {o.code}", 0) + 1
        return figures | {
            "deliveries": queue_snapshot.received,
            "replays": queue_snapshot.transient_replays,
            "not_acked": codes,
        }
    finally:
        report = await managed.shutdown()
        await client.close()
        if not report.succeeded:
            raise SystemExit(f"RUN FAILED: shutdown:\n{report.render()}")


async def child_ingest(config: dict[str, Any], commands: CommandLog) -> dict[str, Any]:
    """No dedup: batches of documents, one insert_many each, one multiple ACK."""
    client: AsyncMongoClient[Any] = AsyncMongoClient(config["mongo_uri"], event_listeners=[commands])
    orders = client[config["database"]][BUSINESS]
    pending: list[aio_pika.abc.AbstractIncomingMessage] = []
    settled = 0
    flushing = asyncio.Lock()
    timer: asyncio.TimerHandle | None = None
    tasks: set[asyncio.Task[None]] = set()

    async def flush() -> None:
        nonlocal settled, pending
        async with flushing:
            batch, pending = pending, []
            if not batch:
                return
            documents = [
                business_document(str(m.headers[EVENT_ID_HEADER]), Order.model_validate_json(m.body)) for m in batch
            ]
            await orders.insert_many(documents, ordered=False)
            await batch[-1].ack(multiple=True)
            settled += len(batch)

    def schedule() -> None:
        nonlocal timer
        if timer is not None:
            timer.cancel()
            timer = None
        task = asyncio.ensure_future(flush())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        nonlocal timer
        pending.append(message)
        if len(pending) >= INGEST_BATCH:
            schedule()
        elif timer is None:
            timer = asyncio.get_running_loop().call_later(INGEST_WAIT, schedule)

    connection = await aio_pika.connect_robust(config["amqp_url"])
    window = Window(commands, config["server_pid"])
    try:
        channel = await connection.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=2 * INGEST_BATCH)
        declared = await channel.declare_queue(config["queue"], passive=True)
        window.arm()
        await declared.consume(on_message, no_ack=False)

        return await window.until(lambda: settled, config["messages"], config["timeout"])
    finally:
        await connection.close()
        await client.close()


async def child_single(config: dict[str, Any], commands: CommandLog) -> dict[str, Any]:
    """bench_inbox's lily or hand-written contender, its first phase only (no duplicates)."""
    run = child_lily if config["kind"] == "lily" else child_hand
    start = server_cpu(config["server_pid"])
    figures = await run(config | {"relay": False, "lease_first": False, "duplicates": 0}, commands)
    first = figures["first"]
    sent = sum(1 for phase, *_ in commands.commands if phase == "first")
    return {
        "seconds": first["seconds"],
        "cpu": first["cpu"],
        "server_cpu": server_cpu(config["server_pid"]) - start,  # its start-up included: a few ms
        "commands": sent,
    }


async def child(config: dict[str, Any]) -> int:
    commands = CommandLog()
    kind = config["kind"]
    if kind.startswith("batch-"):
        figures = await child_batch(config, commands)
    elif kind == "ingest":
        figures = await child_ingest(config, commands)
    else:
        sys.stdout = sys.stderr  # bench_inbox's contenders announce their phases on stdout
        try:
            figures = await child_single(config, commands)
        finally:
            sys.stdout = sys.__stdout__
    client: AsyncMongoClient[Any] = AsyncMongoClient(config["mongo_uri"])
    try:
        stored = await client[config["database"]][BUSINESS].count_documents({})
    finally:
        await client.close()
    print(json.dumps({"result": figures | {"stored": stored}}), flush=True)
    return 0


# -- the parent ------------------------------------------------------------------------------------


async def run_child(
    args: argparse.Namespace, connection: aio_pika.abc.AbstractConnection, kind: str, round_: int
) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:10]
    options = QueueOptions(name=f"bench.batch.{tag}", concurrency=1, prefetch=4096)
    config: dict[str, Any] = {
        "kind": kind,
        "size": int(kind.split("-")[1]) if kind.startswith("batch-") else 0,
        "mongo_uri": args.mongo_uri,
        "amqp_url": args.amqp_url,
        "queue": options.name,
        "database": f"bench_batch_{tag}",
        "messages": args.events,
        "concurrency": 1,
        "prefetch": 64,
        "timeout": args.timeout,
        "server_pid": args.server_pid,
    }
    rng = random.Random(round_)
    messages = [
        (str(uuid.uuid4()), {"order_id": f"order-{round_}-{i}", "amount": rng.randint(1, 100_000)})
        for i in range(args.events)
    ]
    await declare(connection, options)
    try:
        await publish(args.amqp_url, options.name, messages)
        if (ready := await depth(connection, options.name)) != args.events:
            raise SystemExit(f"the queue holds {ready} messages after publishing {args.events}")
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(SCRIPT), "--child", json.dumps(config), stdout=asyncio.subprocess.PIPE
        )
        assert process.stdout is not None
        try:
            line = await asyncio.wait_for(process.stdout.readline(), timeout=args.timeout + 120)
            status = await asyncio.wait_for(process.wait(), timeout=60)
        except BaseException:
            if process.returncode is None:
                process.kill()
                await process.wait()
            raise
        if status != 0 or not line:
            raise SystemExit(f"a {kind} child exited with status {status}")
        figures: dict[str, Any] = json.loads(line)["result"]
    finally:
        channel = await connection.channel()
        for name in (options.name, options.dlq_name):
            await channel.queue_delete(name)
        await channel.close()
        client: AsyncMongoClient[Any] = AsyncMongoClient(args.mongo_uri)
        try:
            await client.drop_database(config["database"])
        finally:
            await client.close()
    if figures["stored"] != args.events:
        raise SystemExit(f"{kind}: {figures['stored']} documents stored for {args.events} events")
    return figures | {"kind": kind, "round": round_}


def summarise(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    kinds = args.kinds
    summary: dict[str, Any] = {}
    for kind in kinds:
        mine = [r for r in runs if r["kind"] == kind]
        summary[kind] = {
            "events_per_s": statistics.median(args.events / r["seconds"] for r in mine),
            "commands_per_event": statistics.median(r["commands"] / args.events for r in mine),
            "cpu_us_per_event": statistics.median(r["cpu"] / args.events * 1e6 for r in mine),
            "server_cpu_us_per_event": statistics.median(r["server_cpu"] / args.events * 1e6 for r in mine),
        }
    ratios: dict[str, dict[str, float]] = {}
    for kind in kinds:
        for base in ("lily", "hand", "ingest"):
            per_round = []
            for round_ in range(1, args.rounds + 1):
                rate = {r["kind"]: args.events / r["seconds"] for r in runs if r["round"] == round_}
                if kind in rate and base in rate:
                    per_round.append(rate[kind] / rate[base])
            if per_round and kind != base:
                ratios.setdefault(kind, {})[base] = statistics.median(per_round)
    return {"contenders": summary, "ratios": ratios}


def print_summary(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    print()
    print(f"{args.events} events per run, {args.rounds} rounds; medians; CPU per event in microseconds")
    header = f"{'contender':<10} {'events/s':>9} {'cmds/event':>10} {'consumer CPU':>12} {'server CPU':>10}   ratios"
    print(header)
    print("-" * (len(header) + 40))
    for kind, e in summary["contenders"].items():
        ratios = summary["ratios"].get(kind, {})
        shown = "  ".join(f"x{value:.2f} {base}" for base, value in ratios.items())
        print(
            f"{kind:<10} {e['events_per_s']:9.0f} {e['commands_per_event']:10.3f} {e['cpu_us_per_event']:12.0f} "
            f"{e['server_cpu_us_per_event']:10.0f}   {shown}"
        )


async def parent(args: argparse.Namespace) -> int:
    out = sys.stderr if args.json else sys.stdout
    server = None
    args.amqp_url = os.environ.get("LILY_AMQP_URL", DEFAULT_AMQP_URL)
    args.mongo_uri = os.environ.get("LILY_MONGO_URI")
    args.server_pid = None
    backend = "MongoDB from LILY_MONGO_URI (its CPU is not read)"
    if not args.mongo_uri:
        server = EmbeddedServer(majority_latency_ms=args.majority_latency_ms)
        args.mongo_uri = await server.start()
        assert server.process is not None
        args.server_pid = server.process.pid
        backend = "the embedded MongoDB-wire emulator (mongoeco), its CPU read from /proc"
        if args.majority_latency_ms:
            backend += f", every commit and majority write answered {args.majority_latency_ms:g} ms after it applied"
    args.kinds = [*(f"batch-{n}" for n in args.sizes), "lily", "hand", "ingest"]
    runs: list[dict[str, Any]] = []
    try:
        connection = await aio_pika.connect(args.amqp_url)
        try:
            print(
                f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs; {backend}; "
                f"{args.events} events per run; {args.rounds} rounds (order alternating)",
                file=out,
            )
            for round_ in range(1, args.rounds + 1):
                order = args.kinds if round_ % 2 else args.kinds[::-1]
                for kind in order:
                    run = await run_child(args, connection, kind, round_)
                    runs.append(run)
                    extra = ""
                    if run.get("deliveries", args.events) != args.events or run.get("replays"):
                        extra = f"; {run['deliveries']} deliveries, {run['replays']} replays, {run['not_acked']}"
                    print(
                        f"round {round_} {kind:<9}: {args.events / run['seconds']:7.0f} events/s, "
                        f"{run['commands'] / args.events:.3f} commands/event, consumer CPU "
                        f"{run['cpu'] / args.events * 1e6:6.0f} us/event, server CPU "
                        f"{run['server_cpu'] / args.events * 1e6:6.0f} us/event{extra}",
                        file=out,
                        flush=True,
                    )
        finally:
            await connection.close()
    finally:
        if server is not None:
            await server.stop()
    summary = summarise(args, runs)
    if args.json:
        print(json.dumps({"backend": backend, "events": args.events, "summary": summary, "runs": runs}, indent=1))
    else:
        print_summary(args, summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--events", type=int, default=20_000, help="events per run (default 20000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of one run per contender (default 3)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 500], help="batch sizes (default 10 100 500)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per run (default 120 + events/10)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON (progress on stderr)")
    parser.add_argument(
        "--majority-latency-ms",
        type=float,
        default=0.0,
        help="embedded server only: a replica set's wait for the majority on every commit and majority write "
        "(default 0; docs/emulator.md)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return asyncio.run(child(json.loads(args.child)))
    if args.majority_latency_ms and os.environ.get("LILY_MONGO_URI"):
        parser.error("--majority-latency-ms models the wait on the embedded server; LILY_MONGO_URI has its own")
    if args.events < 1 or args.rounds < 1 or min(args.sizes) < 1:
        parser.error("--events, --rounds and --sizes must be >= 1")
    args.timeout = args.timeout or 120 + args.events / 10
    return asyncio.run(parent(args))


if __name__ == "__main__":
    raise SystemExit(main())
