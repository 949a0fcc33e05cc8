"""Consume throughput against peers: lily_mongo at_least_once, raw aio-pika and FastStream, same queue contents.

Setup: this benchmark needs the ``bench`` dependency group (FastStream, matplotlib),
which the tests and ``scripts/bootstrap.sh`` do not install; ``uv sync`` is exact,
so a later bootstrap removes the group again::

    uv sync --locked --all-extras --group bench
    uv run --locked --no-sync python benchmarks/bench_peers.py [--messages 20000] [--rounds 5]
        [--prefetch 64 256] [--lily-concurrency N] [--timeout 240] [--chart peers.png] [--profile DIR]

(``LILY_AMQP_URL`` selects the broker; default the local RabbitMQ as guest.)

Three consumers of the same pydantic model (``Item``) from the same messages:

* lily: ``Consumer`` without Mongo, one ``@queue(..., guarantee="at_least_once")``
  handler taking ``Json[Item]`` (envelope validation, dispatch, JSON + pydantic
  decode, settlement, observation), ``configure_queue(prefetch=P, concurrency=C)``;
* raw: aio-pika robust connection, ``set_qos(P)``, a consumer callback that runs
  ``Item.model_validate_json(body)`` and ACKs;
* faststream: ``RabbitBroker`` with a ``@broker.subscriber(RabbitQueue(...),
  channel=Channel(prefetch_count=P))`` handler taking ``item: Item``, the default
  ACK policy (ACK after the handler returns; no ACK-first, no no-ack). The
  broker gets ``logger=None``: FastStream's default access log writes two INFO
  lines per message, a cost neither other contender has.

Comparable concurrency: aio-pika (under raw and FastStream alike) runs every
delivery's callback in a task of its own, so both handle up to ``P`` deliveries
at once, bounded only by the prefetch. lily therefore gets ``concurrency = P``
by default (``--lily-concurrency`` overrides it); its effective prefetch is then
``P`` as well. The settings are printed.

Every (round, contender) gets a fresh queue, declared like lily declares its
queues. Before a round its three queues are filled at once: ``--messages``
transient messages, each published once with confirms to a fanout exchange
bound to the three queues (removed afterwards), with the canonical Lily
envelope headers built by ``prepare_publication``; so every contender reads
the same bodies and event ids, and only consumption is timed. Each contender
runs in a fresh child process (interpreter start, imports and connecting are
not timed); the order rotates from round to round. Inside the child one probe times all three alike: the
clock and the process CPU time (``time.process_time``) start at the first
delivery frame aiormq reads and stop when the last ``basic.ack`` has been
written to the socket (aiormq's ``Channel.basic_ack`` returns; every contender
ACKs through it: raw and FastStream one delivery tag at a time, lily with
``multiple`` ACKs where its ``ack_delay`` coalesces them). The child also counts the handled
messages and checks the decoded ids, and reports the system share of its CPU
time and its context switches (``getrusage``), printed with each run next to
how busy it was (CPU time over wall time). A consumer well under 100 % busy
was waiting for the broker, which shares the machine: its msgs/s then say
more about the broker and the machine than about the consumer, and the CPU
per message is the steadier measure of the consumer's own cost.

Reported per prefetch: each run's msgs/s and consumer CPU µs per message, the
medians with min..max, and the per-round paired ratios lily/raw and
lily/FastStream as a median with min..max: throughput (lily's msgs/s over the
peer's; above 1, lily is faster) and CPU per message (lily's over the peer's;
below 1, lily is cheaper). Pairing runs that ran seconds apart cancels most of
the drift of a shared, noisy machine. A child that stalls past ``--timeout`` is
killed and its run reported failed (an ``x`` at 0 in the chart, exit status 1);
rounds with a failed contender drop out of that pair's ratios.
``--chart PATH`` writes a PNG of the rounds (matplotlib); ``--profile DIR``
writes a cProfile ``.pstats`` of each child's timed phase (the timings of a
profiled run are not comparable). Each round deletes its queues.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import aio_pika.abc
import aiormq
import pydantic
from pamqp.commands import Basic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lily_mongo import Consumer, Json, QueueOptions, RetryPolicy, queue
from lily_mongo._topology import declare_topology, topology_names
from lily_mongo.bounds import BOUNDS
from lily_mongo.publisher import JSON, prepare_publication

SCRIPT = Path(__file__).resolve()
DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"
CONTENDERS = ("lily", "raw", "faststream")
LABELS = {"lily": "lily_mongo", "raw": "raw aio-pika", "faststream": "FastStream"}
PUBLISH_BATCH = 1000
SETTLE_SECONDS = 1.0  # before starting a consumer: lets the broker and the previous child wind down
TEARDOWN_SECONDS = 20.0  # a child's shutdown bound
RESULT_PREFIX = "RESULT "


class Item(pydantic.BaseModel):
    id: int
    sku: str
    qty: int


def payload(i: int) -> dict[str, Any]:
    return {"id": i, "sku": f"SKU-{i % 97}", "qty": 1 + i % 5}


def queue_options(name: str, prefetch: int, concurrency: int) -> QueueOptions:
    """The options lily's child uses; the parent declares every contender's queue with them."""
    return QueueOptions(
        name=name, prefetch=prefetch, concurrency=concurrency, retry=RetryPolicy(max_retries=0, delays=())
    )


# -- the child: one contender consuming one queue ------------------------------------------


class Probe:
    """Times a run from its first delivery frame to its last ACK, the same way for every contender.

    Wraps two methods of aiormq's ``Channel``, through which all three contenders
    receive and ACK: ``_on_deliver_frame`` only until the first delivery (then the
    original is put back), and ``basic_ack``, which counts the deliveries each ACK
    settles and, for the one that settles the last, awaits the write before
    stopping the clocks (a plain call otherwise: every ACK frame pays one extra
    Python call, whoever writes it). A ``multiple`` ACK up to tag N settles every
    tag of its channel up to N not settled before (nothing is NACKed here).
    """

    def __init__(self, expected: int, profiler: cProfile.Profile | None) -> None:
        self.expected = expected
        self.profiler = profiler
        self.acked = 0
        self.first_wall = 0.0
        self.first_cpu = 0.0
        self.end_wall = 0.0
        self.end_cpu = 0.0
        self.first_usage: resource.struct_rusage | None = None
        self.end_usage: resource.struct_rusage | None = None
        self.done = asyncio.Event()
        self._settled: dict[int, tuple[int, set[int]]] = {}  # per channel: floor, single ACKs above it
        self._deliver = aiormq.Channel._on_deliver_frame
        self._ack = aiormq.Channel.basic_ack

    def install(self) -> None:
        deliver, ack, probe = self._deliver, self._ack, self

        async def on_deliver_frame(channel: aiormq.Channel, frame: Any) -> None:
            if not probe.first_wall:
                aiormq.Channel._on_deliver_frame = deliver  # type: ignore[method-assign]
                probe.first_usage = resource.getrusage(resource.RUSAGE_SELF)
                probe.first_cpu = time.process_time()
                probe.first_wall = time.perf_counter()
                if probe.profiler is not None:
                    probe.profiler.enable()
            await deliver(channel, frame)

        def basic_ack(
            channel: aiormq.Channel, delivery_tag: int, multiple: bool = False, wait: bool = True
        ) -> Coroutine[Any, Any, None]:
            before = probe.acked
            probe.acked += probe.settles(channel, delivery_tag, multiple)
            sent = ack(channel, delivery_tag, multiple=multiple, wait=wait)
            return sent if not before < probe.expected <= probe.acked else probe._last(sent)

        aiormq.Channel._on_deliver_frame = on_deliver_frame  # type: ignore[method-assign, assignment]
        aiormq.Channel.basic_ack = basic_ack  # type: ignore[method-assign, assignment]

    def settles(self, channel: aiormq.Channel, tag: int, multiple: bool) -> int:
        """How many deliveries of ``channel`` this ACK settles."""
        floor, singles = self._settled.get(id(channel), (0, set()))
        if not multiple:
            singles.add(tag)
            self._settled[id(channel)] = (floor, singles)
            return 1
        below = {t for t in singles if t <= tag}
        self._settled[id(channel)] = (max(floor, tag), singles - below)
        return max(tag - floor - len(below), 0)

    async def _last(self, sent: Awaitable[None]) -> None:
        await sent
        self.end_wall = time.perf_counter()
        self.end_cpu = time.process_time()
        self.end_usage = resource.getrusage(resource.RUSAGE_SELF)
        if self.profiler is not None:
            self.profiler.disable()
        self.done.set()

    def usage(self) -> dict[str, float]:
        """User and system CPU seconds and context switches over the timed phase (getrusage)."""
        first, end = self.first_usage, self.end_usage
        if first is None or end is None:
            return {}
        return {
            "cpu_user": end.ru_utime - first.ru_utime,
            "cpu_sys": end.ru_stime - first.ru_stime,
            "switches_voluntary": end.ru_nvcsw - first.ru_nvcsw,
            "switches_involuntary": end.ru_nivcsw - first.ru_nivcsw,
        }

    def uninstall(self) -> None:
        aiormq.Channel._on_deliver_frame = self._deliver  # type: ignore[method-assign]
        aiormq.Channel.basic_ack = self._ack  # type: ignore[method-assign]


@dataclass
class Tally:
    """What the handlers saw: how many items and the sum of their ids (checks the decode)."""

    handled: int = 0
    id_sum: int = 0

    def add(self, item: Item) -> None:
        self.handled += 1
        self.id_sum += item.id


async def wait_done(probe: Probe, tally: Tally, seconds: float) -> None:
    try:
        async with asyncio.timeout(seconds):
            await probe.done.wait()
    except TimeoutError:
        raise SystemExit(
            f"stalled: {tally.handled} handled, {probe.acked} ACKed of {probe.expected} within {seconds:g} s"
        ) from None


async def consume_lily(args: argparse.Namespace, url: str, probe: Probe, tally: Tally) -> dict[str, Any]:
    @queue(args.queue, version=1, content="json", guarantee="at_least_once")
    async def on_item(item: Json[Item]) -> None:
        tally.add(item)

    consumer = Consumer(amqp_url=url, name="bench-peers", graceful_timeout=TEARDOWN_SECONDS / 2)
    options = consumer.configure_queue(
        args.queue, prefetch=args.prefetch, concurrency=args.concurrency, retry=RetryPolicy(max_retries=0, delays=())
    )
    consumer.include(on_item)
    managed = await consumer.start()
    try:
        await wait_done(probe, tally, args.wait)
        # An outcome is counted once the frame that settles it was written; the deliveries
        # sharing the last ACK frame are counted a moment after the clocks stopped.
        for _ in range(5000):
            acked = managed.snapshot().queues[0].outcomes.get("acked", 0)
            if acked >= args.messages:
                break
            await asyncio.sleep(0.001)
    finally:
        async with asyncio.timeout(TEARDOWN_SECONDS):
            report = await managed.shutdown()
    if not report.succeeded:
        raise SystemExit(f"lily shutdown did not succeed:\n{report.render()}")
    return {"effective_prefetch": options.effective_prefetch, "lily_acked_outcomes": acked}


async def consume_raw(args: argparse.Namespace, url: str, probe: Probe, tally: Tally) -> dict[str, Any]:
    connection = await aio_pika.connect_robust(url)
    try:
        channel = await connection.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=args.prefetch)
        declared = await channel.declare_queue(args.queue, passive=True)

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            tally.add(Item.model_validate_json(message.body))
            await message.ack()

        await declared.consume(on_message, no_ack=False)
        await wait_done(probe, tally, args.wait)
    finally:
        async with asyncio.timeout(TEARDOWN_SECONDS):
            await connection.close()
    return {}


async def consume_faststream(args: argparse.Namespace, url: str, probe: Probe, tally: Tally) -> dict[str, Any]:
    from faststream.rabbit import Channel, RabbitBroker, RabbitQueue

    broker = RabbitBroker(url, logger=None, graceful_timeout=TEARDOWN_SECONDS / 2)

    # The queue exists already (declared like lily's): declare=False only checks it (passive).
    @broker.subscriber(RabbitQueue(args.queue, declare=False), channel=Channel(prefetch_count=args.prefetch))
    async def on_item(item: Item) -> None:
        tally.add(item)

    await broker.start()
    try:
        await wait_done(probe, tally, args.wait)
    finally:
        async with asyncio.timeout(TEARDOWN_SECONDS):
            await broker.stop()
    return {}


CONSUMERS: dict[str, Callable[[argparse.Namespace, str, Probe, Tally], Awaitable[dict[str, Any]]]] = {
    "lily": consume_lily,
    "raw": consume_raw,
    "faststream": consume_faststream,
}


async def child(args: argparse.Namespace) -> int:
    url = os.environ.get("LILY_AMQP_URL", DEFAULT_URL)
    profiler = cProfile.Profile() if args.profile_out else None
    probe = Probe(args.messages, profiler)
    tally = Tally()
    if args.child == "faststream":
        import faststream.rabbit  # noqa: F401  (imported before the start-up clock, like lily and aio-pika)
    started = time.perf_counter()
    probe.install()
    try:
        extra = await CONSUMERS[args.child](args, url, probe, tally)
    finally:
        probe.uninstall()
    if profiler is not None:
        profiler.dump_stats(args.profile_out)
    result = {
        "kind": args.child,
        "handled": tally.handled,
        "id_sum": tally.id_sum,
        "acked": probe.acked,
        "startup": probe.first_wall - started,
        "flowing": probe.end_wall - probe.first_wall,
        "cpu": probe.end_cpu - probe.first_cpu,
        **probe.usage(),
        **extra,
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


# -- the parent: queues, publishing, child processes, figures -------------------------------


@dataclass
class Run:
    kind: str
    round: int
    flowing: float = 0.0
    cpu: float = 0.0
    startup: float = 0.0
    cpu_sys: float = 0.0
    switches: int = 0  # voluntary + involuntary context switches
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class Setting:
    """All runs at one prefetch."""

    prefetch: int
    concurrency: int
    effective_prefetch: int
    runs: list[Run] = field(default_factory=list)

    def of(self, kind: str) -> list[Run]:
        return [r for r in self.runs if r.kind == kind and r.ok]

    def paired(self, kind: str, attribute: str) -> list[float]:
        """Per round: lily's figure over ``kind``'s; throughput (``flowing``) is inverted to msgs/s."""
        ratios = []
        by_round: dict[int, dict[str, Run]] = {}
        for run in self.runs:
            if run.ok:
                by_round.setdefault(run.round, {})[run.kind] = run
        for pair in by_round.values():
            if "lily" in pair and kind in pair:
                lily, other = getattr(pair["lily"], attribute), getattr(pair[kind], attribute)
                ratios.append(other / lily if attribute == "flowing" else lily / other)
        return ratios


def spread(values: Sequence[float], fmt: str) -> str:
    if not values:
        return "n/a"
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}..{format(max(values), fmt)})"


@dataclass(frozen=True)
class Outgoing:
    """The prepared messages: bodies and AMQP properties (canonical Lily headers, transient)."""

    bodies: list[bytes]
    properties: list[Basic.Properties]

    @classmethod
    def prepare(cls, count: int) -> Outgoing:
        publications = [prepare_publication(JSON, "", payload(i), version=1) for i in range(count)]
        return cls(
            [p.body for p in publications],
            [Basic.Properties(content_type=p.content_type, headers=p.headers, delivery_mode=1) for p in publications],
        )


async def fill(connection: aio_pika.abc.AbstractConnection, names: Sequence[str], outgoing: Outgoing) -> None:
    """Publish every message once, with confirms, through a fanout exchange bound to all ``names``.

    One publish puts the same message in every contender's queue: identical
    contents by construction, and a third of the publishing work (on a 2-core
    machine the broker's enqueue rate is what limits the fill).
    """
    channel = await connection.channel(publisher_confirms=True)
    exchange = await channel.declare_exchange(f"{names[0]}.fill", aio_pika.ExchangeType.FANOUT, durable=False)
    try:
        for name in names:
            declared = await channel.declare_queue(name, passive=True)
            await declared.bind(exchange)
        underlay = await channel.get_underlay_channel()
        count = len(outgoing.bodies)
        for start in range(0, count, PUBLISH_BATCH):
            confirms = await asyncio.gather(
                *(
                    underlay.basic_publish(body, exchange=exchange.name, properties=properties, timeout=60)
                    for body, properties in zip(
                        outgoing.bodies[start : start + PUBLISH_BATCH],
                        outgoing.properties[start : start + PUBLISH_BATCH],
                        strict=True,
                    )
                )
            )
            if not all(isinstance(confirm, Basic.Ack) for confirm in confirms):
                raise SystemExit("the broker did not confirm every published message")
        for name in names:
            depth = await ready(channel, name)
            if depth != count:
                raise SystemExit(f"queue {name} holds {depth} messages after publishing {count}")
    finally:
        with contextlib.suppress(Exception):
            await exchange.delete()  # drops the bindings: each queue keeps exactly its copy
        await channel.close()


async def ready(channel: aio_pika.abc.AbstractChannel, name: str) -> int:
    declared = await channel.declare_queue(name, passive=True)
    return int(declared.declaration_result.message_count or 0)


async def run_child(argv: list[str], timeout: float) -> tuple[dict[str, Any] | None, str]:
    """Run one child; return its result, or None and why it failed (a stalled child is killed)."""
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        return None, f"stalled: killed after {timeout:g} s"
    finally:
        if process.returncode is None:
            process.kill()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), 10)
    for line in reversed(out.decode(errors="replace").splitlines()):
        if line.startswith(RESULT_PREFIX) and process.returncode == 0:
            return json.loads(line[len(RESULT_PREFIX) :]), ""
    lines = [line for line in err.decode(errors="replace").splitlines() if line.strip()]
    return None, f"exit {process.returncode}: {lines[-1][:300] if lines else 'no output'}"


def check(result: dict[str, Any], messages: int) -> str | None:
    """Why a child's result is not a clean run, or None."""
    expected_sum = messages * (messages - 1) // 2
    if result["handled"] != messages or result["id_sum"] != expected_sum:
        return f"handled {result['handled']} of {messages} (id sum {result['id_sum']}, expected {expected_sum})"
    if result["acked"] != messages:
        return f"ACKed {result['acked']} of {messages}"
    if result.get("lily_acked_outcomes", messages) != messages:
        return f"lily counted {result['lily_acked_outcomes']} ACKed outcomes of {messages}"
    return None


async def one_run(
    args: argparse.Namespace,
    connection: aio_pika.abc.AbstractConnection,
    setting: Setting,
    kind: str,
    round_: int,
    name: str,
) -> Run:
    """Run one contender's child on its filled queue ``name`` and check what it did."""
    run = Run(kind, round_)
    argv = [sys.executable, str(SCRIPT), "--child", kind, "--queue", name]
    argv += ["--messages", str(args.messages), "--prefetch", str(setting.prefetch)]
    argv += ["--concurrency", str(setting.concurrency), "--wait", str(max(args.timeout - 30, 10))]
    if args.profile:
        argv += ["--profile-out", str(Path(args.profile) / f"{kind}-p{setting.prefetch}-r{round_}.pstats")]
    await asyncio.sleep(SETTLE_SECONDS)
    result, error = await run_child(argv, args.timeout)
    if result is not None:
        error = check(result, args.messages) or ""
        channel = await connection.channel(publisher_confirms=False)
        try:
            left = await ready(channel, name)
        finally:
            await channel.close()
        if not error and left:
            error = f"{left} messages left in the queue"
    if error or result is None:
        run.error = error
    else:
        run.flowing, run.cpu, run.startup = result["flowing"], result["cpu"], result["startup"]
        run.cpu_sys = result.get("cpu_sys", 0.0)
        run.switches = result.get("switches_voluntary", 0) + result.get("switches_involuntary", 0)
    return run


async def one_round(
    args: argparse.Namespace,
    connection: aio_pika.abc.AbstractConnection,
    outgoing: Outgoing,
    setting: Setting,
    round_: int,
    tag: str,
) -> None:
    """Fill a fresh queue per contender, then run the contenders one after another in this round's order."""
    shift = (round_ - 1) % len(CONTENDERS)
    order = CONTENDERS[shift:] + CONTENDERS[:shift]
    options = {
        kind: queue_options(
            f"bench.peers.{tag}.p{setting.prefetch}.r{round_}.{kind}", setting.prefetch, setting.concurrency
        )
        for kind in order
    }
    try:
        for queue_options_ in options.values():
            await declare_topology(connection, queue_options_)
        await fill(connection, [o.name for o in options.values()], outgoing)
        for kind in order:
            run = await one_run(args, connection, setting, kind, round_, options[kind].name)
            setting.runs.append(run)
            where = f"p{setting.prefetch} round {round_} {LABELS[kind]:<13}:"
            if run.ok:
                print(
                    f"{where} {args.messages / run.flowing:7.0f} msgs/s, CPU {run.cpu / args.messages * 1e6:6.1f} "
                    f"us/msg ({run.cpu_sys / run.cpu:.0%} system; busy {run.cpu / run.flowing:.0%}; "
                    f"{run.switches / args.messages:.2f} context switches/msg; start-up {run.startup:.2f} s)",
                    flush=True,
                )
            else:
                print(f"{where} FAILED: {run.error}", flush=True)
    finally:
        channel = await connection.channel(publisher_confirms=False)
        try:
            for queue_options_ in options.values():
                for name in topology_names(queue_options_):
                    with contextlib.suppress(Exception):
                        await channel.queue_delete(name)
        finally:
            with contextlib.suppress(Exception):
                await channel.close()


def describe_setting(setting: Setting, lily_concurrency: int | None) -> str:
    p = setting.prefetch
    chosen = "--lily-concurrency" if lily_concurrency else "= prefetch, like the other two"
    return (
        f"prefetch {p}: lily configure_queue(prefetch={p}, concurrency={setting.concurrency}) ({chosen}; "
        f"effective prefetch {setting.effective_prefetch}); raw set_qos({p}) and FastStream "
        f"Channel(prefetch_count={p}): one aio-pika task per delivery, up to {p} at once"
    )


def report(setting: Setting, messages: int) -> None:
    print(f"-- prefetch {setting.prefetch}: medians over successful runs (min..max)")
    for kind in CONTENDERS:
        runs = setting.of(kind)
        failed = sum(1 for r in setting.runs if r.kind == kind and not r.ok)
        print(
            f"   {LABELS[kind]:<13} {spread([messages / r.flowing for r in runs], '.0f')} msgs/s, "
            f"CPU {spread([r.cpu / messages * 1e6 for r in runs], '.1f')} us/msg, "
            f"{spread([r.cpu_sys / r.cpu * 100 for r in runs], '.0f')} % of it system time, "
            f"busy {spread([r.cpu / r.flowing * 100 for r in runs], '.0f')} % of the time"
            + (f"; {failed} run(s) FAILED" if failed else "")
        )
    for kind in ("raw", "faststream"):
        throughput, cpu = setting.paired(kind, "flowing"), setting.paired(kind, "cpu")
        print(
            f"   lily/{LABELS[kind]:<13} throughput ratio {spread(throughput, '.2f')}, "
            f"CPU-per-message ratio {spread(cpu, '.2f')} over {len(throughput)} paired rounds "
            f"(throughput per round: {' '.join(f'{r:.2f}' for r in throughput) or '-'})"
        )


def chart(settings: Sequence[Setting], messages: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"lily": "tab:blue", "raw": "tab:gray", "faststream": "tab:orange"}
    figure, axes = plt.subplots(2, len(settings), figsize=(max(8.0, 6.0 * len(settings)), 7.5), squeeze=False)
    for column, setting in enumerate(settings):
        rate, cpu = axes[0][column], axes[1][column]
        for kind in CONTENDERS:
            runs = setting.of(kind)
            rounds = [r.round for r in runs]
            style = {"color": colours[kind], "marker": "o", "label": LABELS[kind]}
            rate.plot(rounds, [messages / r.flowing for r in runs], **style)
            cpu.plot(rounds, [r.cpu / messages * 1e6 for r in runs], **style)
            failed = [r.round for r in setting.runs if r.kind == kind and not r.ok]
            if failed:
                for axis in (rate, cpu):
                    axis.plot(failed, [0] * len(failed), "x", color=colours[kind], markersize=12, clip_on=False)
        ratios = [
            f"lily/{LABELS[k]} {statistics.median(v):.2f}"
            for k in ("raw", "faststream")
            if (v := setting.paired(k, "flowing"))
        ]
        rate.set_title(f"prefetch {setting.prefetch}, lily concurrency {setting.concurrency}\n" + ", ".join(ratios))
        rate.set_ylabel("msgs/s (first delivery to last ACK)")
        cpu.set_ylabel("consumer CPU us per message")
        for axis in (rate, cpu):
            axis.set_xlabel("round")
            axis.set_ylim(bottom=0)
            axis.grid(alpha=0.3)
            axis.xaxis.get_major_locator().set_params(integer=True)
        rate.legend(loc="lower right")
    figure.suptitle(f"Consuming {messages} messages per run\nlily_mongo at_least_once vs raw aio-pika vs FastStream")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "?"


async def bench(args: argparse.Namespace) -> int:
    url = os.environ.get("LILY_AMQP_URL", DEFAULT_URL)
    tag = uuid.uuid4().hex[:8]
    outgoing = Outgoing.prepare(args.messages)
    settings = []
    for prefetch in args.prefetch:
        concurrency = args.lily_concurrency or min(prefetch, BOUNDS.concurrency_max)
        effective = queue_options("bench.peers.check", prefetch, concurrency).effective_prefetch
        settings.append(Setting(prefetch, concurrency, effective))
    print(
        f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}; lily_mongo {version('lily-mongo')}, aio-pika {version('aio-pika')}, "
        f"aiormq {version('aiormq')}, FastStream {version('faststream')}, pydantic {version('pydantic')}"
    )
    print(
        f"{args.messages} messages per run, {args.rounds} rounds per prefetch, each contender in a fresh process, "
        f"order rotating; timed from the first delivery to the last ACK"
    )
    for setting in settings:
        print(describe_setting(setting, args.lily_concurrency))
    if args.profile:
        print(f"profiling every child into {args.profile}: these timings are NOT comparable")
    connection = await aio_pika.connect(url)
    try:
        for setting in settings:
            for round_ in range(1, args.rounds + 1):
                await one_round(args, connection, outgoing, setting, round_, tag)
            report(setting, args.messages)
    finally:
        await connection.close()
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if args.chart:
        chart(settings, args.messages, args.chart)
        print(f"chart written to {args.chart}")
    failed = sum(1 for s in settings for r in s.runs if not r.ok)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=20_000, help="messages per run (default 20000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per prefetch setting (default 5)")
    parser.add_argument(
        "--prefetch", type=int, nargs="+", default=[64, 256], help="prefetch settings to run (default 64 256)"
    )
    parser.add_argument(
        "--lily-concurrency", type=int, default=None, help="lily's concurrency (default: equal to the prefetch)"
    )
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds before a child is killed (default 240)")
    parser.add_argument("--chart", metavar="PATH", help="write a PNG chart of the rounds")
    parser.add_argument("--profile", metavar="DIR", help="write a cProfile .pstats of every child's timed phase")
    # The child side (one contender, one queue); set by the parent.
    parser.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--queue", help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--wait", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--profile-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.prefetch = args.prefetch[0]  # a child runs one setting
        return asyncio.run(child(args))
    if args.messages < 1 or args.rounds < 1 or any(not 1 <= p <= BOUNDS.prefetch_max for p in args.prefetch):
        parser.error(f"--messages and --rounds must be >= 1, each --prefetch 1..{BOUNDS.prefetch_max}")
    if args.lily_concurrency is not None and not 1 <= args.lily_concurrency <= BOUNDS.concurrency_max:
        parser.error(f"--lily-concurrency must be 1..{BOUNDS.concurrency_max}")
    needed = ["faststream", "matplotlib"] if args.chart else ["faststream"]
    if any(importlib.util.find_spec(name) is None for name in needed):
        parser.error("the bench dependency group is missing: uv sync --locked --all-extras --group bench")
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    return asyncio.run(bench(args))


if __name__ == "__main__":
    raise SystemExit(main())
