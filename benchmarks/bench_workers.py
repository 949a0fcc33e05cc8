"""``lily-mongo run --workers``: throughput of one queue with 1 and with 2 worker processes.

Run: ``python benchmarks/bench_workers.py [--messages 20000] [--runs 5] [--workers 2] [--prefetch 64]
[--concurrency 32]`` (``LILY_AMQP_URL`` selects the broker; default the local RabbitMQ as guest).

The consumer is the at-least-once one of ``bench_throughput.py``: a no-op
handler taking ``Json[Item]`` (envelope validation, dispatch, decode,
settlement), prefetch and concurrency per worker as given. Before each timed
run the queue is filled with ``--messages`` messages published with confirms,
then ``lily-mongo run TARGET --workers N`` starts in a fresh process (N = 1
runs the consumer in that process, N > 1 a supervisor and N worker processes,
all competing for the queue). Each worker notes the monotonic clock (one clock
for every process of the machine) and its CPU time at its first and its last
delivery, and writes them when it exits. Once the queue is empty the command
gets SIGTERM and drains.

A run's throughput is the messages over the span from the first worker's first
delivery to the last worker's last one; CPU per message is the workers' CPU
time between their first and last deliveries (the handling, not the start-up),
summed. Rounds alternate which contender runs first; the ratio printed is the
median of the per-round ratios (N workers over 1), beside each contender's
medians. On a machine with fewer free cores than workers plus the broker, more
workers cannot help: the figures say how far they do here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import textwrap
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aio_pika

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_throughput import DEFAULT_URL, fill, ready
from lily_mongo import QueueOptions, RetryPolicy
from lily_mongo._topology import declare_topology, topology_names

TARGET = """
    import atexit, json, os, time
    import pydantic
    from lily_mongo import Consumer, Json, RetryPolicy, queue

    class Item(pydantic.BaseModel):
        id: int
        sku: str
        qty: int

    seen = {{"count": 0, "first": 0.0, "last": 0.0, "cpu_first": 0.0, "cpu_last": 0.0}}

    @queue({queue!r}, version=1, content="json", guarantee="at_least_once")
    async def handle(item: Json[Item]) -> None:
        now = time.monotonic()
        if not seen["count"]:
            seen["first"], seen["cpu_first"] = now, time.process_time()
        seen["count"] += 1
        seen["last"], seen["cpu_last"] = now, time.process_time()

    @atexit.register
    def write() -> None:
        with open(os.path.join({out!r}, f"{{os.getpid()}}.json"), "w") as handle_:
            json.dump(seen, handle_)

    consumer = Consumer(amqp_url=os.environ["LILY_AMQP_URL"], name="bench-workers", telemetry=False)
    consumer.configure_queue({queue!r}, concurrency={concurrency}, prefetch={prefetch},
                             retry=RetryPolicy(max_retries=0, delays=()))
    consumer.include(handle)
"""


@dataclass
class Run:
    messages: int
    span: float  # first delivery of any worker to the last delivery of any
    cpu: float  # the workers' CPU seconds between their first and last deliveries
    per_worker: list[int]
    skew: float  # the last worker's first delivery after the first worker's

    @property
    def throughput(self) -> float:
        return self.messages / self.span


def command(workers: int) -> list[str]:
    script = shutil.which("lily-mongo", path=os.path.dirname(sys.executable))
    base = [script] if script else [sys.executable, "-c", "from lily_mongo._cli.app import main; main()"]
    return [*base, "run", "benchtarget:consumer", "--workers", str(workers), "--log-level", "warning"]


async def one_run(
    url: str, channel: aio_pika.abc.AbstractChannel, name: str, workers: int, args: argparse.Namespace, directory: Path
) -> Run:
    out = directory / f"out-{uuid.uuid4().hex[:8]}"
    out.mkdir()
    source = TARGET.format(queue=name, out=str(out), concurrency=args.concurrency, prefetch=args.prefetch)
    (directory / "benchtarget.py").write_text(textwrap.dedent(source))
    await fill(channel, name, args.messages)
    env = {**os.environ, "LILY_AMQP_URL": url}
    log = directory / "command.log"
    with log.open("w") as output:
        process = await asyncio.create_subprocess_exec(
            *command(workers), cwd=directory, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=output, stderr=output
        )
    try:
        deadline = time.monotonic() + 300
        while await ready(channel, name):
            if process.returncode is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"the command ended ({process.returncode}) or took too long with messages left:\n{log.read_text()}"
                )
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the last prefetched messages are handled
        process.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(process.wait(), 120)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    if code != 0:
        raise SystemExit(f"lily-mongo run --workers {workers} exited {code}:\n{log.read_text()}")
    seen = [json.loads(path.read_text()) for path in out.glob("*.json")]
    active = [s for s in seen if s["count"]]
    handled = sum(s["count"] for s in active)
    # Messages still buffered (received, not started) at SIGTERM go back to the queue: counted, then purged.
    returned = await ready(channel, name)
    if handled + returned != args.messages:
        raise SystemExit(f"{handled} handled and {returned} returned of {args.messages} with {workers} worker(s)")
    if returned:
        await (await channel.declare_queue(name, passive=True)).purge()
    span = max(s["last"] for s in active) - min(s["first"] for s in active)
    cpu = sum(s["cpu_last"] - s["cpu_first"] for s in active)
    skew = max(s["first"] for s in active) - min(s["first"] for s in active)
    return Run(handled, span, cpu, sorted((s["count"] for s in active), reverse=True), skew)


async def bench(args: argparse.Namespace) -> int:
    url = os.environ.get("LILY_AMQP_URL", DEFAULT_URL)
    name = f"bench.workers.{uuid.uuid4().hex[:8]}"
    options = QueueOptions(name=name, retry=RetryPolicy(max_retries=0, delays=()))
    kinds = (1, args.workers)
    connection = await aio_pika.connect(url)
    directory = Path(tempfile.mkdtemp(prefix="lily-bench-workers-"))
    try:
        await declare_topology(connection, options)
        channel = await connection.channel(publisher_confirms=True)
        print(
            f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} cores; "
            f"{args.messages} messages per run, {args.runs} rounds (order alternating); per worker prefetch "
            f"{args.prefetch}, concurrency {args.concurrency}; 1 against {args.workers} worker processes"
        )
        runs: dict[int, list[Run]] = {kind: [] for kind in kinds}
        ratios: list[float] = []
        for round_ in range(1, args.runs + 1):
            for workers in kinds if round_ % 2 else tuple(reversed(kinds)):
                run = await one_run(url, channel, name, workers, args, directory)
                runs[workers].append(run)
                print(
                    f"round {round_} {workers} worker(s): {run.throughput:7.0f} msgs/s, CPU "
                    f"{run.cpu / run.messages * 1e6:6.1f} us/msg, messages per worker {run.per_worker}, "
                    f"start skew {run.skew:.2f} s"
                )
            ratios.append(runs[args.workers][-1].throughput / runs[1][-1].throughput)
        for workers in kinds:
            throughput = statistics.median(r.throughput for r in runs[workers])
            cpu = statistics.median(r.cpu / r.messages * 1e6 for r in runs[workers])
            print(f"{workers} worker(s): median {throughput:7.0f} msgs/s, CPU {cpu:.1f} us/msg")
        print(f"per-round ratios {args.workers}/1: {' '.join(f'{r:.2f}' for r in ratios)}")
        print(f"throughput ratio {args.workers} workers / 1, median of rounds: {statistics.median(ratios):.2f}")
    finally:
        cleanup = await connection.channel()
        for queue_name in topology_names(options):
            await cleanup.queue_delete(queue_name)
        await connection.close()
        shutil.rmtree(directory, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=20_000, help="messages per run (default 20000)")
    parser.add_argument("--runs", type=int, default=5, help="rounds of one run of each contender (default 5)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes against 1 (default 2)")
    parser.add_argument("--prefetch", type=int, default=64, help="prefetch per worker (default 64)")
    parser.add_argument("--concurrency", type=int, default=32, help="handler concurrency per worker (default 32)")
    return asyncio.run(bench(parser.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
