"""The AsyncAPI document's DLQ message against real DLQ copies (real broker).

Messages refused for their envelope, refused by the handler, broker-dead-lettered
for their size, and one whose metadata was not valid UTF-8 all reach ``Q.dlq``;
the headers each one carries there must validate against the DLQ message's
header schema, read as JSON the way docs/asyncapi.md states (AMQP strings as
strings, integers as integers, timestamps as RFC 3339 strings, byte arrays as
base64 strings, tables as objects, arrays as arrays).
"""

from __future__ import annotations

import base64
import datetime
import decimal
import uuid
from typing import Any

import aio_pika
import aio_pika.abc
import jsonschema
import pydantic

from lily_mongo.asyncapi import asyncapi_document
from tests.support.broker import Broker
from tests.support.consumers import NO_RETRIES, wait_observations
from tests.support.frames import RawProducer, long_string_value, raw_properties, raw_table
from tests.support.handlers import rejecting


class Item(pydantic.BaseModel):
    n: int


def as_json(value: Any) -> Any:
    """An AMQP header value as JSON data (the mapping docs/asyncapi.md states)."""
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, dict):
        return {str(k): as_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_json(v) for v in value]
    return value


async def test_every_kind_of_real_dlq_copy_validates_against_the_dlq_message(broker: Broker) -> None:
    q = broker.queue("asyncapi-dlq")
    consumer = broker.consumer(q, rejecting(q), name="asyncapi-dlq", max_body=64, retry=NO_RETRIES)
    schema = asyncapi_document(consumer.plan())["components"]["messages"][f"{q}.dead-lettered"]["headers"]
    envelope = {"x-lily-schema-version": "1", "x-lily-content-kind": "json"}
    sent: list[tuple[dict[str, Any], bytes]] = [
        (envelope, b'{"n": 1}'),  # no event id
        ({**envelope, "x-lily-event-id": "order-7"}, b'{"n": 2}'),  # not a UUID
        ({**envelope, "x-lily-event-id": str(uuid.uuid4()), "x-lily-schema-version": 1}, b'{"n": 3}'),
        ({**envelope, "x-lily-event-id": str(uuid.uuid4()), "x-retry-count": "2"}, b'{"n": 4}'),
        ({**envelope, "x-lily-event-id": str(uuid.uuid4())}, b'{"n": 5}'),  # refused by the handler
        ({**envelope, "x-lily-event-id": str(uuid.uuid4()), "x-lily-failure-code": "FORGED"}, b" " * 100),  # oversize
    ]
    managed = await consumer.start()
    raw = await RawProducer.open(broker.url)
    try:
        for headers, body in sent:
            await broker.channel.default_exchange.publish(aio_pika.Message(body, headers=headers), routing_key=q)
        # Metadata that is not UTF-8: the copy holds the lenient reading.
        table = raw_table([(b"x-lily-event-id", long_string_value(str(uuid.uuid4()))), (b"x-\xff", b"t\x01")])
        await raw.publish("", q.encode(), raw_properties(headers=table), b'{"n": 7}')
        await wait_observations(managed, len(sent) + 1)
    finally:
        await raw.close()
        await managed.shutdown()
    assert await broker.wait_for_depth(f"{q}.dlq", len(sent) + 1) == len(sent) + 1
    copies = await broker.drain(f"{q}.dlq")
    check = jsonschema.Draft7Validator(schema)
    kinds = set()
    for copy in copies:
        headers = as_json(dict(copy.headers))
        check.validate(headers)
        kinds.add("broker" if "x-death" in headers else headers["x-lily-failure-code"])
    assert kinds == {"broker", "QUEUE_ENVELOPE_INVALID", "ITEM_REJECTED"}
