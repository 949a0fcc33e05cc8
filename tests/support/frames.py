"""AMQP 0-9-1 frames written by hand, and a producer that sends them.

What a producer in any language may send and RabbitMQ accepts, including what the
Python client libraries would never write: header names or short strings that are not UTF-8.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any, Self, TypeVar

from pamqp import commands as spec
from pamqp import frame as pamqp_frame
from yarl import URL

T = TypeVar("T")


def short_bytes(raw: bytes) -> bytes:
    """An AMQP short string holding ``raw`` as it is (valid UTF-8 or not)."""
    assert len(raw) <= 255
    return bytes((len(raw),)) + raw


def long_string_value(text: str) -> bytes:
    """A header table value of type ``S`` (long string)."""
    raw = text.encode()
    return b"S" + len(raw).to_bytes(4) + raw


def raw_table(entries: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A field table from (name bytes, encoded value) pairs: names are written as they are."""
    payload = b"".join(short_bytes(name) + value for name, value in entries)
    return len(payload).to_bytes(4) + payload


def raw_properties(
    *,
    content_type: bytes | None = None,
    headers: bytes | None = None,
    delivery_mode: int | None = None,
    message_id: bytes | None = None,
    message_type: bytes | None = None,
) -> bytes:
    """The property flags and list of a content header, each field written as given (AMQP 0-9-1 order)."""
    flags = 0
    parts: list[bytes] = []
    fields: tuple[tuple[int, bytes | int | None], ...] = (
        (15, content_type),
        (13, headers),
        (12, delivery_mode),
        (7, message_id),
        (5, message_type),
    )
    for bit, value in fields:
        if value is None:
            continue
        flags |= 1 << bit
        if isinstance(value, int):
            parts.append(bytes((value,)))  # the delivery mode, an octet
        elif bit == 13:
            parts.append(value)  # an encoded table
        else:
            parts.append(short_bytes(value))
    return flags.to_bytes(2) + b"".join(parts)


class RawProducer:
    """A minimal AMQP 0-9-1 producer on a socket, writing frames by hand.

    It sends what a producer in any language may send and RabbitMQ accepts, including
    metadata the Python client libraries would never write: header names or short
    strings that are not UTF-8. Publishes are mandatory and wait for the confirm.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, url: str) -> RawProducer:
        parsed = URL(url)
        reader, writer = await asyncio.open_connection(parsed.host, parsed.port or 5672)
        producer = cls(reader, writer)
        writer.write(b"AMQP\x00\x00\x09\x01")
        await producer.expect(spec.Connection.Start)
        response = f"\0{parsed.user or 'guest'}\0{parsed.password or 'guest'}"
        producer.send(0, spec.Connection.StartOk(client_properties={}, mechanism="PLAIN", response=response))
        tune = await producer.expect(spec.Connection.Tune)
        producer.send(0, spec.Connection.TuneOk(channel_max=tune.channel_max, frame_max=tune.frame_max, heartbeat=0))
        vhost = parsed.path[1:] or "/"
        producer.send(0, spec.Connection.Open(virtual_host=vhost))
        await producer.expect(spec.Connection.OpenOk)
        producer.send(1, spec.Channel.Open())
        await producer.expect(spec.Channel.OpenOk)
        producer.send(1, spec.Confirm.Select())
        await producer.expect(spec.Confirm.SelectOk)
        return producer

    def send(self, channel: int, method: Any) -> None:
        self.writer.write(pamqp_frame.marshal(method, channel))

    async def expect(self, kind: type[T], timeout: float = 10.0) -> T:
        head = await asyncio.wait_for(self.reader.readexactly(7), timeout)
        rest = await asyncio.wait_for(self.reader.readexactly(int.from_bytes(head[3:7]) + 1), timeout)
        received = pamqp_frame.unmarshal(head + rest)[2]
        assert isinstance(received, kind), f"expected {kind.__name__}, got {received!r}"
        return received

    async def publish(self, exchange: str, routing_key: bytes, properties: bytes, body: bytes) -> None:
        """basic.publish (mandatory) with a hand-made content header; wait for the broker's ack."""
        method = b"\x00\x3c\x00\x28\x00\x00" + short_bytes(exchange.encode()) + short_bytes(routing_key) + b"\x01"
        content_header = b"\x00\x3c\x00\x00" + len(body).to_bytes(8) + properties
        for kind, payload in ((1, method), (2, content_header), (3, body)):
            self.writer.write(bytes((kind,)) + (1).to_bytes(2) + len(payload).to_bytes(4) + payload + b"\xce")
        await self.writer.drain()
        await self.expect(spec.Basic.Ack)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        try:
            self.send(0, spec.Connection.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0))
            await self.expect(spec.Connection.CloseOk, timeout=2.0)
        finally:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
