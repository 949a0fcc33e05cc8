"""The README's service on the embedded MongoDB: one worker against ``--workers 2``, lily's server against mongoeco's.

Run: ``python benchmarks/bench_readme_service.py [--messages 200] [--duplicates 20] [--rounds 3]
[--workers 1 2] [--json]`` (``LILY_AMQP_URL`` selects the broker; default the local RabbitMQ as guest).

What a new user does (README.md, "Your own service on the embedded MongoDB"): the
service is the README's ``myservice.py`` as written (handler concurrency 8, the
default), its URI's port and its queue name changed to the run's; it runs with
``lily-mongo run myservice:consumer --workers N`` against ``python -m
lily_mongo.embedded`` (the server ``lily-mongo embedded`` runs) or, for the
comparison, ``python -m lily_mongo.embedded --as-shipped`` (mongoeco as it ships).
Each run is a fresh server process, a fresh service (its workers) and a fresh
queue; rounds alternate the order of the four combinations.

Once the service is ready (``/readyz``), ``--messages`` orders are published
(``publish_json``, as in the README; 20 at a time, their confirms awaited together),
with ``--duplicates`` second copies of some of them (the same event id) placed after
their first copies. The wall time runs from the first publish to the last
settlement: the time on the service's log line of the last copy acked or found a
duplicate (``--log-level debug --log-format json`` writes one line per delivery).
Transient replays and deferrals are the service's own counters, read once from its
``/metrics`` (``--http-port``) at the end; which deliveries were deferred, and why,
from its per-delivery log lines: a *deferral of a first-time delivery* is a deferral
of an event that was published once, a *lease* one has the code ``LEASE_HELD``,
``LEASE_BUSY`` or ``LEASE_LOST``. After the run, ``shop.orders``
must hold every order exactly once.

Done when (issue 32), on lily's server with 2 workers: transient replays at most 5 %
of deliveries, no lease deferral of a first-time delivery, wall time no worse than
one worker's.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from pymongo import AsyncMongoClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lily_mongo import Publisher
from lily_mongo._metrics import DELIVERIES, QUEUE_COUNTERS

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "## Your own service on the embedded MongoDB"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
SERVERS = ("lily", "shipped")
LABELS = {"lily": "lily_mongo.embedded", "shipped": "mongoeco as it ships"}
LEASE_CODES = frozenset({"LEASE_HELD", "LEASE_BUSY", "LEASE_LOST"})
COUNTERS = {metric.prometheus_name: metric.field for metric in QUEUE_COUNTERS}
PUBLISH_BATCH = 20


def readme_service(port: int, queue: str) -> str:
    """The README's ``myservice.py`` with the run's MongoDB port and queue name."""
    section = README.read_text(encoding="utf-8").split(SECTION, 1)[1]
    match = re.search(r"```python\n(.*?)```", section, flags=re.DOTALL)
    if match is None:
        raise SystemExit("the README's embedded section has no python block")
    source = match.group(1)
    if 'AsyncMongoClient("mongodb://127.0.0.1:27017/")' not in source or '"orders.created"' not in source:
        raise SystemExit("the README's service changed: update the benchmark's substitutions")
    return source.replace("127.0.0.1:27017", f"127.0.0.1:{port}").replace('"orders.created"', repr(queue))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def cli(*args: str) -> list[str]:
    script = shutil.which("lily-mongo", path=os.path.dirname(sys.executable))
    if script is not None:
        return [script, *args]
    return [sys.executable, "-c", "from lily_mongo.cli import main; main()", *args]


async def start_server(server: str) -> tuple[asyncio.subprocess.Process, int]:
    command = [sys.executable, "-m", "lily_mongo.embedded", "--port", "0"]
    if server == "shipped":
        command.append("--as-shipped")
    process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
    if not line.startswith("READY "):
        raise SystemExit(f"the embedded server did not start: {line!r}")
    return process, int(line.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])


async def stop(process: asyncio.subprocess.Process, timeout: float = 30) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), timeout)
        except TimeoutError:
            process.kill()
            await process.wait()


async def scrape(session: aiohttp.ClientSession, port: int) -> dict[str, float]:
    """The service's counters summed over its queues and workers: deliveries by outcome, replays, deferrals."""
    async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
        text = await response.text()
    counts: dict[str, float] = collections.defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            if family.name == DELIVERIES.prometheus_name:
                counts[f"outcome:{sample.labels['outcome']}"] += sample.value
            elif family.name in COUNTERS:
                counts[COUNTERS[family.name]] += sample.value
    return dict(counts)


async def run(args: argparse.Namespace, server: str, workers: int, round_: int) -> dict[str, Any]:
    """One run: a fresh server, the README service with ``workers`` workers, the messages; its figures."""
    mongo, mongo_port = await start_server(server)
    queue = f"bench.readme.{uuid.uuid4().hex[:10]}"
    http_port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="bench-readme-"))
    (workdir / "myservice.py").write_text(readme_service(mongo_port, queue))
    env = dict(os.environ, PYTHONUNBUFFERED="1", NO_COLOR="1")
    argv = cli("run", "myservice:consumer", "--workers", str(workers), "--http-port", str(http_port))
    argv += ["--log-level", "debug", "--log-format", "json"]
    service = await asyncio.create_subprocess_exec(
        *argv, cwd=workdir, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    assert service.stderr is not None
    lines: list[str] = []
    ends: list[float] = []  # when each copy was acked or found a duplicate (its log line's time)
    events = [uuid.uuid4() for _ in range(args.messages)]
    twice = set(random.sample(range(args.messages), args.duplicates))
    total = args.messages + args.duplicates
    all_settled = asyncio.Event()

    async def read_log() -> None:
        assert service.stderr is not None
        async for raw in service.stderr:
            line = raw.decode(errors="replace")
            lines.append(line)
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and record.get("outcome") in ("acked", "duplicate"):
                    ends.append(datetime.datetime.fromisoformat(record["time"]).timestamp())
                    if len(ends) >= total:
                        all_settled.set()

    reader = asyncio.create_task(read_log())
    copies = list(enumerate(events))
    # Each second copy goes somewhere after its first copy.
    for i in sorted(twice):
        copies.insert(random.randint(copies.index((i, events[i])) + 1, len(copies)), (i, events[i]))
    try:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 60
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"http://127.0.0.1:{http_port}/readyz") as response:
                        if response.status == 200:
                            break
                if service.returncode is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the service did not get ready:\n{''.join(lines[-20:])}")
                await asyncio.sleep(0.1)
            async with Publisher(args.amqp_url) as publisher:
                started = time.time()
                for at in range(0, len(copies), PUBLISH_BATCH):  # in order, a batch's confirms awaited together
                    await asyncio.gather(
                        *(
                            publisher.publish_json(
                                queue,
                                {"order_id": f"order-{round_}-{i}", "total_cents": 100 + i},
                                version=1,
                                event_id=event,
                            )
                            for i, event in copies[at : at + PUBLISH_BATCH]
                        )
                    )
                published = time.time() - started
            try:
                await asyncio.wait_for(all_settled.wait(), args.timeout)
            except TimeoutError:
                raise SystemExit(f"{server} x{workers}: {len(ends)} of {total} settled in time") from None
            wall = max(ends) - started
            counts = await scrape(http, http_port)
        connection = await aio_pika.connect(args.amqp_url)
        try:
            channel = await connection.channel()
            depth = (await channel.declare_queue(queue, passive=True)).declaration_result.message_count
        finally:
            await connection.close()
        client: AsyncMongoClient[Any] = AsyncMongoClient(f"mongodb://127.0.0.1:{mongo_port}/")
        try:
            orders = await client.shop.orders.count_documents({"_id": {"$regex": f"^order-{round_}-"}})
        finally:
            await client.close()
    finally:
        await stop(service)
        await reader
        await stop(mongo)
        shutil.rmtree(workdir, ignore_errors=True)
    once = {str(event) for i, event in enumerate(events) if i not in twice}
    deferred: collections.Counter[str] = collections.Counter()
    first_time = first_time_lease = 0
    for line in lines:
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("outcome") == "deferred":
                deferred[str(record.get("code"))] += 1
                if record.get("event_id") in once:
                    first_time += 1
                    first_time_lease += record.get("code") in LEASE_CODES
    if depth or orders != args.messages:
        raise SystemExit(f"{server} x{workers}: queue depth {depth}, {orders} of {args.messages} orders recorded")
    return {
        "server": server,
        "workers": workers,
        "round": round_,
        "deliveries": total,
        "wall_s": wall,
        "publish_s": published,
        "replays": counts.get("transient_replays", 0),
        "deferrals": counts.get("deferrals", 0),
        "deferrals_by_code": dict(deferred),
        "first_time_deferrals": first_time,
        "first_time_lease_deferrals": first_time_lease,
        "outcomes": {k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("outcome:")},
    }


def summarise(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for server in args.servers:
        for workers in args.workers:
            mine = [r for r in runs if r["server"] == server and r["workers"] == workers]
            summary[f"{server} x{workers}"] = {
                "wall_s": statistics.median(r["wall_s"] for r in mine),
                "replays_per_delivery": statistics.median(r["replays"] / r["deliveries"] for r in mine),
                "deferrals": statistics.median(r["deferrals"] for r in mine),
                "first_time_deferrals": max(r["first_time_deferrals"] for r in mine),
                "first_time_lease_deferrals": max(r["first_time_lease_deferrals"] for r in mine),
            }
        if len(args.workers) == 2:
            one, more = args.workers
            by_round = {(r["round"], r["workers"]): r for r in runs if r["server"] == server}
            summary[f"{server} wall x{more}/x{one}"] = statistics.median(
                by_round[(n, more)]["wall_s"] / by_round[(n, one)]["wall_s"] for n in range(1, args.rounds + 1)
            )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=200, help="orders per run (default 200)")
    parser.add_argument("--duplicates", type=int, default=20, help="second copies among them (default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts (default 1 2)")
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--timeout", type=float, default=600, help="seconds a run may take (default 600)")
    parser.add_argument("--json", action="store_true", help="print the runs and the summary as JSON")
    args = parser.parse_args(argv)
    if not 0 <= args.duplicates <= args.messages or args.rounds < 1:
        parser.error("--duplicates must be within 0..--messages, --rounds >= 1")
    args.amqp_url = os.environ.get("LILY_AMQP_URL", DEFAULT_AMQP_URL)
    print(
        f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs; the README service; "
        f"{args.messages} orders + {args.duplicates} duplicate copies per run; {args.rounds} rounds; "
        f"workers {args.workers}; servers {args.servers}",
        flush=True,
    )
    combinations = [(s, w) for s in args.servers for w in args.workers]
    runs: list[dict[str, Any]] = []
    for round_ in range(1, args.rounds + 1):
        for server, workers in combinations if round_ % 2 else combinations[::-1]:
            result = asyncio.run(run(args, server, workers, round_))
            runs.append(result)
            print(
                f"round {round_} {LABELS[server]:<22} workers {workers}: {result['wall_s']:6.1f} s, "
                f"replays {result['replays']:5.0f} ({result['replays'] / result['deliveries']:.1%} of deliveries), "
                f"deferrals {result['deferrals']:4.0f} {result['deferrals_by_code']}, "
                f"of first-time deliveries {result['first_time_deferrals']} "
                f"(lease: {result['first_time_lease_deferrals']})",
                flush=True,
            )
    args.servers = [s for s in SERVERS if s in args.servers]
    summary = summarise(runs, args)
    print("\nmedians of rounds (deferrals of first-time deliveries: the most in any round)")
    for key, value in summary.items():
        if isinstance(value, dict):
            print(
                f"  {key:<14} wall {value['wall_s']:6.1f} s, replays {value['replays_per_delivery']:.1%} of "
                f"deliveries, deferrals {value['deferrals']:.0f}, of first-time deliveries "
                f"{value['first_time_deferrals']} (lease: {value['first_time_lease_deferrals']})"
            )
        else:
            print(f"  {key}: {value:.2f}")
    if args.json:
        print(json.dumps({"summary": summary, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
