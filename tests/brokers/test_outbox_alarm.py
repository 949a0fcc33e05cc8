"""The outbox under a real memory alarm: the broker blocks the outbox's connection (``connection.blocked``),
and the outbox publishes nothing, parks nothing, counts the wait, and delivers every record once the alarm
clears (docs/outbox.md, "Failure classes").

The alarm is raised with ``rabbitmqctl set_vm_memory_high_watermark`` on a node ``scripts/brokers.sh``
runs, never on the shared broker of 5672, and the node's watermark is always put back.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from yarl import URL

from lily_mongo import OutboxOptions
from lily_mongo._outbox import Outbox, OutboxTransaction
from tests.integration.test_outbox import OUTBOX, event_ids
from tests.support.broker import Broker
from tests.support.mongo import MongoDB
from tests.support.polling import eventually

pytestmark = pytest.mark.broker

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "brokers.sh"
# The nodes scripts/brokers.sh runs, by AMQP port (its `ctl` takes these names).
NODES = {5743: "r43", 5740: "r40", 5751: "c43-1", 5752: "c43-2", 5753: "c43-3"}
ALARM_SECONDS = 6.0


def ctl(node: str, *args: str) -> str:
    done = subprocess.run(
        ["bash", str(SCRIPT), "ctl", node, *args], check=True, capture_output=True, text=True, timeout=120
    )
    return done.stdout.strip()


@contextlib.contextmanager
def memory_alarm(node: str) -> Iterator[None]:
    """A memory alarm on ``node`` (a watermark of almost nothing); its watermark put back afterwards."""
    before = ctl(node, "eval", "vm_memory_monitor:get_vm_memory_high_watermark().")
    try:
        float(before)
    except ValueError:
        pytest.skip(f"the node's watermark is not a plain fraction ({before!r}): not changed")
    try:
        ctl(node, "set_vm_memory_high_watermark", "0.0000001")
        yield
    finally:
        ctl(node, "set_vm_memory_high_watermark", before)


async def test_a_memory_alarm_blocks_publishing_parks_nothing_and_every_record_is_delivered_after_it(
    amqp: str, broker: Broker, mongodb: MongoDB
) -> None:
    node = NODES.get(URL(amqp).port or 5672)
    if node is None:
        pytest.skip("a memory alarm is raised only on a node scripts/brokers.sh runs, not the shared broker")
    down = await broker.declare(broker.queue("down"))
    options = OutboxOptions(
        max_attempts=2, poll_interval=0.05, backoff_base=0.05, backoff_max=0.5, count_interval=0.1, claim_seconds=5.0
    )
    outbox = Outbox(mongodb.client, mongodb.name, amqp_url=amqp, options=options, confirm_timeout=0.5)
    written: list[str] = []
    async with outbox:
        counters = outbox.process.counters
        with memory_alarm(node):
            for n in range(10):

                async def write(tx: OutboxTransaction, n: int = n) -> list[str]:
                    return [str(await tx.publish_json(down, {"n": n, "i": i}, version=1)) for i in range(2)]

                written += await outbox.transaction(write)
            await asyncio.sleep(ALARM_SECONDS)
            assert await mongodb.db[OUTBOX].count_documents({"status": "failed"}) == 0
            assert counters.blocked_seconds > 0  # the wait is counted (lily.outbox.blocked on /metrics)

        async def all_published() -> bool:
            return await mongodb.db[OUTBOX].count_documents({"status": "published"}) == len(written)

        await eventually(all_published, what="every record published after the alarm", timeout=30)
    docs = await mongodb.db[OUTBOX].find({}).to_list()
    assert {(doc["status"], doc["attempts"]) for doc in docs} == {("published", 0)}
    assert set(event_ids(await broker.drain(down))) == set(written)
