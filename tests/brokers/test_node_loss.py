"""A node loss on the three-node cluster (c43 of scripts/brokers.sh; docs/deployment.md, "Clusters").

300 events, each applied with one outbox message to a destination queue, flow through two
consumer processes (``workers/cluster_worker.py``) given the cluster's nodes in different
orders, so each starts on a node of its own. The test SIGKILLs the node the first consumer is
connected to, then the node that leads the work queue (a quorum queue, as its retry buckets,
its DLQ and the destination are), then starts both again. Expected: every event applied once
(the business collection holds each event id once), every outbox message in the destination
queue, and each consumer consuming again after each loss; the times it took are printed.

Runs only on the cluster (``c43`` in ``LILY_BROKERS``), where it SIGKILLs nodes: nothing else
may use that cluster meanwhile (``.ci/run`` runs the broker tier's tests one at a time).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from lily_mongo import Publisher, QueueOptions, RetryPolicy
from lily_mongo._amqp import connect_amqp
from lily_mongo._errors import LilyError
from lily_mongo._topology import topology_names
from tests.brokers.conftest import TARGETS, unavailable
from tests.support.mongo import MongoDB
from tests.support.polling import eventually
from tests.support.processes import ROOT, Workers, run, worker_processes

pytestmark = pytest.mark.broker

WORKER = Path(__file__).resolve().parent / "workers" / "cluster_worker.py"
BROKERS = ROOT / "scripts" / "brokers.sh"
# The cluster's nodes as scripts/brokers.sh runs them: name, AMQP port.
NODES = {"c43-1": 5751, "c43-2": 5752, "c43-3": 5753}
EVENTS = 300
WAVE = EVENTS // 3
PACE = 0.2  # seconds between two events after a loss: a wave lasts 20 s, beyond a reconnect (5 s and more)


def cluster_url(order: Sequence[str]) -> str:
    """One URL naming the cluster's nodes in ``order``."""
    return "amqp://guest:guest@" + ",".join(f"127.0.0.1:{NODES[n]}" for n in order) + "/"


def node_of(address: str) -> str:
    [name] = [name for name, port in NODES.items() if address == f"127.0.0.1:{port}"]
    return name


@pytest.fixture
def cluster() -> str:
    """The cluster's URL (all three nodes), when c43 is listed in LILY_BROKERS and answers."""
    target = next((t for t in TARGETS if t.name == "c43" and t.url), None)
    if target is None:
        pytest.skip("the node-loss test runs on the cluster c43 of scripts/brokers.sh (LILY_BROKERS=...,c43=...)")
    for name, port in NODES.items():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=3).close()
        except OSError as error:
            unavailable(f"node {name} of c43 does not answer on 127.0.0.1:{port} ({error}): scripts/brokers.sh up c43")
    return cluster_url(list(NODES))


async def brokers(*args: str) -> str:
    done = await run(["bash", str(BROKERS), *args], timeout=240.0)
    assert done.returncode == 0, done.describe()
    return done.stdout


async def queues(node: str, *columns: str) -> list[dict[str, Any]]:
    """``rabbitmqctl list_queues COLUMNS`` on ``node``, one dict per queue."""
    listing: list[dict[str, Any]] = json.loads(
        await brokers("ctl", node, "list_queues", "-q", *columns, "--formatter", "json")
    )
    return listing


async def leader_of(queue: str, alive: str) -> str:
    """The node leading ``queue``, as the live node ``alive`` reports it."""
    [leader] = [row["leader"] for row in await queues(alive, "name", "leader") if row["name"] == queue]
    return str(leader).removeprefix("lily-").removesuffix("@localhost")


@contextlib.asynccontextmanager
async def all_nodes_back() -> AsyncIterator[None]:
    """Whatever the test killed is started again on the way out."""
    try:
        yield
    finally:
        for node in NODES:
            await brokers("start", node)


class Stream:
    """Publishes events through the cluster, each one until confirmed (a node loss may leave a publish
    unconfirmed: it is sent again with the same event id, which the consumers' inbox applies once)."""

    def __init__(self, url: str, q: str) -> None:
        self.url, self.q = url, q
        self.sent: list[uuid.UUID] = []
        self.resent = 0

    async def wave(self, count: int, every: float = 0.0) -> None:
        """``count`` events, one every ``every`` s (paced, the stream outlasts a reconnect: otherwise the
        consumer that kept its node could take the whole wave before the other one is back)."""
        async with Publisher(self.url, confirm_timeout=5.0) as publisher:
            for _ in range(count):
                await asyncio.sleep(every)
                event = uuid.uuid4()
                while True:
                    try:
                        await publisher.publish_json(self.q, {"n": len(self.sent)}, version=1, event_id=event)
                        break
                    except (LilyError, aio_pika.exceptions.AMQPError, OSError, TimeoutError):
                        self.resent += 1
                        await asyncio.sleep(0.5)
                self.sent.append(event)


async def first_effect_after(
    mongodb: MongoDB, worker: str, moment: float, timeout: float, *, not_on: str | None = None
) -> dict[str, Any]:
    """The first event ``worker`` applied after ``moment`` (time.time()), through a connection to a node
    other than ``not_on`` when given (a delivery taken before the loss may still be applied after it),
    waiting up to ``timeout`` s."""
    found: list[dict[str, Any]] = []
    where: dict[str, Any] = {"worker": worker, "at": {"$gt": moment}}
    if not_on is not None:
        where["node"] = {"$ne": f"127.0.0.1:{NODES[not_on]}"}

    async def applied() -> bool:
        found[:] = await mongodb.db["effects"].find(where).sort("at").to_list(1)
        return bool(found)

    await eventually(applied, what=f"{worker} to apply an event after the loss", timeout=timeout, interval=0.1)
    return found[0]


async def test_a_node_loss_loses_nothing_and_applies_nothing_twice(
    cluster: str, mongodb: MongoDB, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stamp = uuid.uuid4().hex[:8]
    q, down = f"lt.{stamp}.cluster", f"lt.{stamp}.cluster-down"
    options = QueueOptions(name=q, queue_type="quorum", retry=RetryPolicy(max_retries=5, delays=(0.5,)))
    async with fresh_channel(cluster) as channel:
        await channel.declare_queue(down, durable=True, arguments={"x-queue-type": "quorum"})
    stream = Stream(cluster, q)
    common = ["--mongo-uri", mongodb.uri, "--database", mongodb.name, "--queue", q, "--down", down]
    recoveries: list[str] = []
    try:
        async with all_nodes_back(), worker_processes(WORKER, tmp_path) as workers:
            await workers.start("consumer-a", *common, "--amqp", cluster_url(["c43-1", "c43-2", "c43-3"]))
            await workers.start("consumer-b", *common, "--amqp", cluster_url(["c43-2", "c43-3", "c43-1"]))
            a_node = node_of((await workers.wait_for_record("consumer-a", "ready"))["node"])
            b_node = node_of((await workers.wait_for_record("consumer-b", "ready"))["node"])
            assert (a_node, b_node) == ("c43-1", "c43-2")
            types = {row["name"]: row["type"] for row in await queues("c43-3", "name", "type")}
            # The work queue, its retry buckets and its DLQ, as the consumers declared them; the destination.
            assert {name: types.get(name) for name in (*topology_names(options), down)} == dict.fromkeys(
                (*topology_names(options), down), "quorum"
            )

            await stream.wave(WAVE)
            await applied_at_least(mongodb, WAVE // 2, workers)

            # 1. The node consumer A is connected to.
            await brokers("kill", a_node)
            lost = time.time()
            publishing = asyncio.create_task(stream.wave(WAVE, every=PACE))
            for worker in ("consumer-a", "consumer-b"):
                effect = await first_effect_after(mongodb, worker, lost, timeout=60.0, not_on=a_node)
                recoveries.append(
                    f"{a_node} killed: {worker} consumed again after {effect['at'] - lost:.1f} s "
                    f"(through {node_of(effect['node'])})"
                )
            await publishing

            # 2. The node that leads the work queue now (one node is left: the queues wait for a majority).
            alive = next(n for n in NODES if n != a_node)
            leader = await leader_of(q, alive)
            assert leader != a_node
            await brokers("kill", leader)
            lost = time.time()
            publishing = asyncio.create_task(stream.wave(WAVE, every=PACE))
            await asyncio.sleep(3.0)
            await brokers("start", a_node)
            majority = time.time()  # two nodes of three again
            await brokers("start", leader)
            back = time.time()
            for worker in ("consumer-a", "consumer-b"):
                effect = await first_effect_after(mongodb, worker, lost, timeout=90.0, not_on=leader)
                recoveries.append(
                    f"{leader} (the work queue's leader) killed, {a_node} back {majority - lost:.1f} s later, "
                    f"{leader} {back - lost:.1f} s later: {worker} consumed again after {effect['at'] - lost:.1f} s "
                    f"({effect['at'] - majority:+.1f} s after the majority was back; through {node_of(effect['node'])})"
                )
            await publishing

            async def all_applied() -> bool:
                return await mongodb.db["effects"].count_documents({}) >= EVENTS

            await eventually(all_applied, what="every event applied", timeout=120.0, interval=0.2)

            async def all_published() -> bool:
                pending = await mongodb.db["lily_outbox"].count_documents({"status": {"$ne": "published"}})
                return pending == 0

            await eventually(all_published, what="every outbox message published", timeout=60.0, interval=0.2)
            for name in ("consumer-a", "consumer-b"):
                ended = await workers.children[name].stop(timeout=30.0)
                assert ended.returncode == 0, ended.describe()

        effects = await mongodb.db["effects"].find({}, {"event_id": 1, "worker": 1, "_id": 0}).to_list()
        applied = collections.Counter(doc["event_id"] for doc in effects)
        async with fresh_channel(cluster) as channel:  # every node is back: any of them will do
            arrived = await drain_froms(channel, down)
            assert await channel.declare_queue(q, passive=True) is not None
        sent = {str(e) for e in stream.sent}
        lost_events = sent - set(applied)
        doubled = {e for e, n in applied.items() if n > 1}
        by_worker = collections.Counter(doc["worker"] for doc in effects)
        with capsys.disabled():
            print(f"\nnode loss on c43: {len(sent)} events sent ({stream.resent} publishes sent again)")
            for line in recoveries:
                print(f"  {line}")
            print(
                f"  applied {sum(applied.values())} ({dict(by_worker)}), "
                f"lost {len(lost_events)}, doubled {len(doubled)}; "
                f"destination: {sum(arrived.values())} messages, {len(arrived)} events, "
                f"{sum(n - 1 for n in arrived.values())} copies sent again"
            )
        assert len(sent) == EVENTS
        assert lost_events == set()
        assert doubled == set()
        assert set(applied) == sent
        assert set(arrived) == sent  # every applied event's outbox message reached the destination
    finally:
        with contextlib.suppress(Exception):
            async with fresh_channel(cluster) as channel:
                for name in (*topology_names(options), down):
                    await channel.queue_delete(name)


async def applied_at_least(mongodb: MongoDB, count: int, workers: Workers) -> None:
    async def enough() -> bool:
        for child in workers.children.values():
            await child.check_running()
        return await mongodb.db["effects"].count_documents({}) >= count

    await eventually(enough, what=f"{count} events applied", timeout=60.0, interval=0.1)


@contextlib.asynccontextmanager
async def fresh_channel(url: str) -> AsyncIterator[aio_pika.abc.AbstractChannel]:
    """A channel on a connection of its own to the first live node of ``url`` (the test kills nodes: a
    connection opened at the start may be gone by the end); closed afterwards."""
    connection = await connect_amqp(url, robust=False)
    try:
        yield await connection.channel()
    finally:
        await connection.close()


async def drain_froms(channel: aio_pika.abc.AbstractChannel, down: str) -> collections.Counter[str]:
    """How many messages of the destination name each event (their ``from``), the queue emptied."""
    queue = await channel.declare_queue(down, passive=True)
    arrived: collections.Counter[str] = collections.Counter()
    while (message := await queue.get(no_ack=True, fail=False, timeout=5)) is not None:
        arrived[json.loads(message.body)["from"]] += 1
    return arrived
