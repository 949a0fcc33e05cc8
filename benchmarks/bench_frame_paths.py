"""What each frame-path patch buys: the at-least-once consumer with and without them, same queue contents.

    uv run --locked --no-sync python benchmarks/bench_frame_paths.py [--messages 10000] [--rounds 5] [--prefetch 64]
        [--profile DIR]

(``LILY_AMQP_URL`` selects the broker; default the local RabbitMQ as guest.) It needs
no extra group: the consumer is bench_peers.py's lily contender, run in a fresh child
process per run, timed by its probe (first delivery frame to last ACK, CPU with
``time.process_time``). Four variants of ``lily_mongo._amqp.patches``, chosen in the
child before it connects:

* ``fast``: both patches, as on the tested aiormq/pamqp versions;
* ``stock``: neither (the version lookup reports an untested aiormq), as on any other version;
* ``receiver``: lily's receiver only (the channel frame queue keeps aiormq's 10-frame bound);
* ``queue``: the unbounded frame queue only (aiormq's receiver and pamqp decode).

Each round fills one queue per variant with the same messages (bench_peers.py's
publication) and runs the variants one after another, the order rotating from round
to round. Reported: per variant the median CPU µs per delivery and msgs/s (min..max),
and per round the paired differences against ``stock`` (µs per delivery saved) and
throughput ratios (variant over stock), as medians with min..max. ``--profile DIR``
writes a cProfile ``.pstats`` of each child's timed phase (its timings are then not
comparable; the profiles show where the time goes). The figures in
``lily_mongo/_amqp/patches.py`` come from this script.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aio_pika

from benchmarks import bench_peers as peers
from lily_mongo._amqp import patches
from lily_mongo._topology import declare_topology, topology_names

SCRIPT = Path(__file__).resolve()
VARIANTS = ("fast", "stock", "receiver", "queue")
VARIANT_ENV = "LILY_BENCH_FRAME_VARIANT"


def apply(variant: str) -> None:
    """Set the child's patches to ``variant`` before it connects."""
    import lily_mongo._engine.intake as intake

    # The module globals the lookups read (neither name is exported).
    if variant in ("stock", "queue"):
        real: Callable[[str], str | None] = vars(patches)["installed_version"]
        vars(patches)["installed_version"] = lambda name: "999.0" if name == "aiormq" else real(name)
        patches.active.cache_clear()
    if variant == "receiver":
        vars(intake)["unbounded_frame_queue"] = lambda channel: None
    if variant == "queue":

        def lift(channel: Any) -> None:
            channel.frames._maxsize = 0

        vars(intake)["unbounded_frame_queue"] = lift


def spread(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}..{format(max(values), fmt)})"


async def bench(args: argparse.Namespace) -> int:
    url = os.environ.get("LILY_AMQP_URL", peers.DEFAULT_URL)
    tag = uuid.uuid4().hex[:8]
    outgoing = peers.Outgoing.prepare(args.messages)
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    rate: dict[str, list[float]] = {v: [] for v in VARIANTS}
    saved: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ratio: dict[str, list[float]] = {v: [] for v in VARIANTS}
    print(
        f"aiormq {peers.version('aiormq')}, pamqp {peers.version('pamqp')}; {args.messages} messages per run, "
        f"{args.rounds} rounds, prefetch = concurrency = {args.prefetch}; variants {', '.join(VARIANTS)}"
    )
    connection = await aio_pika.connect(url)
    try:
        for round_ in range(1, args.rounds + 1):
            shift = (round_ - 1) % len(VARIANTS)
            order = VARIANTS[shift:] + VARIANTS[:shift]
            options = {
                v: peers.queue_options(f"bench.paths.{tag}.r{round_}.{v}", args.prefetch, args.prefetch) for v in order
            }
            results: dict[str, dict[str, Any]] = {}
            try:
                for queue_options in options.values():
                    await declare_topology(connection, queue_options)
                await peers.fill(connection, [o.name for o in options.values()], outgoing)
                for variant in order:
                    argv = [sys.executable, str(SCRIPT), "--child", "lily", "--queue", options[variant].name]
                    argv += ["--messages", str(args.messages), "--prefetch", str(args.prefetch)]
                    argv += ["--concurrency", str(args.prefetch), "--wait", str(max(args.timeout - 30, 10))]
                    if args.profile:
                        argv += ["--profile-out", str(Path(args.profile) / f"{variant}-r{round_}.pstats")]
                    await asyncio.sleep(peers.SETTLE_SECONDS)
                    os.environ[VARIANT_ENV] = variant
                    result, error = await peers.run_child(argv, args.timeout)
                    error = error if result is None else (peers.check(result, args.messages) or "")
                    if error or result is None:
                        print(f"round {round_} {variant:<8}: FAILED {error}", flush=True)
                        continue
                    results[variant] = result
                    us = result["cpu"] / args.messages * 1e6
                    print(
                        f"round {round_} {variant:<8}: {args.messages / result['flowing']:7.0f} msgs/s, "
                        f"CPU {us:6.1f} us/msg",
                        flush=True,
                    )
            finally:
                os.environ.pop(VARIANT_ENV, None)
                channel = await connection.channel(publisher_confirms=False)
                for queue_options in options.values():
                    for name in topology_names(queue_options):
                        with contextlib.suppress(Exception):
                            await channel.queue_delete(name)
                with contextlib.suppress(Exception):
                    await channel.close()
            for variant, result in results.items():
                cpu[variant].append(result["cpu"] / args.messages * 1e6)
                rate[variant].append(args.messages / result["flowing"])
                stock = results.get("stock")
                if stock is not None:
                    saved[variant].append((stock["cpu"] - result["cpu"]) / args.messages * 1e6)
                    ratio[variant].append(stock["flowing"] / result["flowing"])
    finally:
        await connection.close()
    print("-- medians (min..max) over the rounds")
    for variant in VARIANTS:
        print(
            f"   {variant:<8} CPU {spread(cpu[variant], '.1f')} us/msg, {spread(rate[variant], '.0f')} msgs/s; "
            f"against stock: {spread(saved[variant], '.1f')} us/msg saved, throughput x{spread(ratio[variant], '.2f')}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=10_000, help="messages per run (default 10000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--prefetch", type=int, default=64, help="prefetch and concurrency (default 64)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds before a child is killed (default 240)")
    parser.add_argument("--profile", metavar="DIR", help="write a cProfile .pstats of every child's timed phase")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args(argv)
    if args.child:
        apply(os.environ.get(VARIANT_ENV, "fast"))
        return peers.main(argv)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    return asyncio.run(bench(args))


if __name__ == "__main__":
    raise SystemExit(main())
