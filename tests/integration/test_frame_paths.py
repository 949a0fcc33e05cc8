"""Which receiver reads a real connection's frames, and the stock path doing the fast path's work (real broker).

On the aiormq and pamqp versions the suite runs on, a connection opened by the package
reads its frames with lily's receiver ("fast"). On any other version (faked here through
the version lookup; the libraries are untouched) it reads them with aiormq's own
receiver ("stock"), says so once at INFO, and still consumes, ACKs, and refuses a
delivery whose metadata is not valid UTF-8 (the lenient reader works on both paths).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import aio_pika.abc
import pytest
from yarl import URL

from lily_mongo._amqp import LenientFrameReader, LenientTransport, connect_amqp, frame_path
from tests.integration.test_malformed_frames import envelope_entries, make_consumer, publish_valid
from tests.support.broker import Broker, BrokerNames
from tests.support.consumers import wait_observations
from tests.support.frames import RawProducer, long_string_value, raw_properties, raw_table
from tests.versions import untested


@pytest.fixture
def readers(monkeypatch: pytest.MonkeyPatch) -> list[LenientFrameReader]:
    """Every lenient reader a connection is given from now on (the transport itself unchanged)."""
    created: list[LenientFrameReader] = []
    create = LenientTransport.create

    async def recording(self: LenientTransport, url: URL, **kwargs: Any) -> Any:
        made = await create(self, url, **kwargs)
        assert self.reader is not None
        created.append(self.reader)
        return made

    monkeypatch.setattr(LenientTransport, "create", recording)
    return created


@pytest.fixture
def untested_aiormq(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with untested(monkeypatch, "aiormq"):
        yield


async def test_on_the_tested_versions_a_connection_reads_with_lilys_receiver(amqp: str, names: BrokerNames) -> None:
    connection = await connect_amqp(amqp, robust=False)
    try:
        assert frame_path(connection) == "fast"
        # Frames do arrive through it: a declaration's answer and a message read back.
        channel = await connection.channel()
        q = names.queue("fast")
        declared = await channel.declare_queue(q, auto_delete=True)
        await channel.default_exchange.publish(aio_pika.Message(b"{}"), routing_key=q)
        message = await declared.get(timeout=5)
        assert message.body == b"{}"
        await message.ack()
    finally:
        await connection.close()


async def test_outside_the_tested_versions_the_consumer_runs_on_aiormqs_receiver(
    broker: Broker,
    raw_producer: RawProducer,
    untested_aiormq: None,
    readers: list[LenientFrameReader],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="lily_mongo")
    q = broker.queue("stock")
    seen: list[int] = []
    managed = await make_consumer(broker.url, q, seen).start()
    try:
        headers = raw_table([*envelope_entries(str(uuid.uuid4())), (b"x-\xff", long_string_value("v"))])
        await raw_producer.publish(
            "", q.encode(), raw_properties(content_type=b"application/json", headers=headers), b"{}"
        )
        for n in (1, 2, 3):
            await publish_valid(raw_producer, q, n)
        observations = await wait_observations(managed, 4)
    finally:
        report = await managed.shutdown()
    assert readers, "the consumer opened no connection through the lenient transport"
    assert [reader.receiver for reader in readers] == ["stock"] * len(readers)
    assert sorted(seen) == [1, 2, 3]
    assert sorted((o.outcome, o.code) for o in observations) == [
        ("acked", None),
        ("acked", None),
        ("acked", None),
        ("dead_lettered", "QUEUE_ENVELOPE_INVALID"),
    ]
    assert report.succeeded, report.render()
    assert await broker.depths(q, f"{q}.dlq") == [0, 1]
    [copy] = await broker.drain(f"{q}.dlq")
    assert copy.headers["x-lily-failure-reason"] == "a header name is not valid UTF-8"
    said = [r for r in caplog.records if r.name == "lily_mongo" and "aiormq's own receiver" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert said[0].levelno == logging.INFO
    assert "aiormq 8.0.0" in said[0].getMessage()
