"""A standalone relay shows its work: its transport generation while ready, the run's totals in its report."""

from __future__ import annotations

import re

from lily_mongo import Outbox, OutboxOptions, OutboxTransaction, Relay
from tests.support.broker import Broker
from tests.support.mongo import MongoDB


async def test_a_ready_relay_has_a_transport_generation_and_its_report_ends_with_what_it_published(
    broker: Broker, mongodb: MongoDB
) -> None:
    down = await broker.declare(broker.queue("down"))
    outbox = Outbox(mongodb.client, mongodb.name, telemetry=False)

    async def write(tx: OutboxTransaction) -> None:
        await tx.publish_json(down, {"n": 1}, version=1)
        await tx.publish_json(down, {"n": 2}, version=1)

    await outbox.transaction(write)
    relay = Relay(mongodb.client, mongodb.name, amqp_url=broker.url, options=OutboxOptions(poll_interval=0.1))
    assert relay.snapshot().transport_generation == 0  # not connected yet
    async with relay:
        assert await broker.wait_for_depth(down, 2) == 2
        assert relay.ready
        assert relay.snapshot().transport_generation == 1
        report = await relay.shutdown()
    assert report.totals == {"published": 2, "unroutable": 0}
    assert re.fullmatch(r"run totals: published=2 in \d+\.\d s", report.render().splitlines()[-1]), report.render()
