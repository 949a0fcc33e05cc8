"""The lenient frame reader between a connection's socket and aiormq's frame receiver (no broker).

Frames are fed to a stream and read back through aiormq's own ``FrameReceiver`` and through
lily's ``FastFrameReceiver`` (which must agree), the way a connection reads them:
ordinary frames come through byte for byte; a delivery whose metadata pamqp cannot decode
comes through readable and marked instead of ending the connection.
"""

from __future__ import annotations

import asyncio
import datetime
import types
from collections.abc import Iterator
from typing import Any

import aiormq.abc
import aiormq.connection
import aiormq.exceptions
import pytest
from pamqp import body as pamqp_body
from pamqp import commands as spec
from pamqp import frame as pamqp_frame
from pamqp import header as pamqp_header
from pamqp.common import FieldTable
from pamqp.heartbeat import Heartbeat

from lily_mongo._amqp import MALFORMED_HEADER, AmqpMessage, LenientFrameReader, LilyProperties, patches
from lily_mongo._amqp.patches import FastFrameReceiver, unbounded_frame_queue
from tests.support.equality import same
from tests.support.frames import long_string_value, raw_properties, raw_table, short_bytes
from tests.versions import untested

# aiormq's own receiver, as the module defined it (once the fast path is active the global
# names lily's subclass of it).
FrameReceiver = FastFrameReceiver.__mro__[1]

EVENT_ID = "0f8fad5b-d9cb-469f-a165-70867728950e"
ENVELOPE = [
    (b"x-lily-event-id", long_string_value(EVENT_ID)),
    (b"x-lily-schema-version", long_string_value("1")),
    (b"x-lily-content-kind", long_string_value("json")),
]


def wire(channel: int, kind: int, payload: bytes) -> bytes:
    return bytes((kind,)) + channel.to_bytes(2) + len(payload).to_bytes(4) + payload + b"\xce"


def content_header(properties: bytes, body_size: int = 2, channel: int = 1) -> bytes:
    return wire(channel, 2, b"\x00\x3c\x00\x00" + body_size.to_bytes(8) + properties)


def deliver(routing_key: bytes, tag: int = 7, channel: int = 1) -> bytes:
    payload = b"\x00\x3c\x00\x3c" + short_bytes(b"ctag-1") + tag.to_bytes(8) + b"\x01"
    return wire(channel, 1, payload + short_bytes(b"") + short_bytes(routing_key))


def get_ok(routing_key: bytes, tag: int = 9, count: int = 41) -> bytes:
    payload = b"\x00\x3c\x00\x47" + tag.to_bytes(8) + b"\x00" + short_bytes(b"amq.direct") + short_bytes(routing_key)
    return wire(1, 1, payload + count.to_bytes(4))


async def receive(data: bytes, count: int) -> list[tuple[int, Any]]:
    """(channel, frame) for the first ``count`` frames of ``data``, read as a connection reads them.

    Read through aiormq's receiver and through lily's: both must give the same frames, or
    raise the same error.
    """
    outcomes: list[list[tuple[int, Any]] | BaseException] = []
    for make in (FrameReceiver, FastFrameReceiver):
        stream = asyncio.StreamReader()
        stream.feed_data(data)
        stream.feed_eof()
        receiver = make(LenientFrameReader(stream))
        frames: list[tuple[int, Any]] = []
        try:
            for _ in range(count):
                _, channel, frame = await receiver.get_frame()
                frames.append((channel, frame))
        except Exception as exc:
            outcomes.append(exc)
        else:
            outcomes.append(frames)
    aiormqs, lilys = outcomes
    assert same(lilys, aiormqs)
    if isinstance(lilys, BaseException):
        raise lilys
    return lilys


async def test_ordinary_frames_pass_byte_for_byte() -> None:
    properties = LilyProperties(
        content_type="application/json", delivery_mode=2, headers={"x-lily-event-id": EVENT_ID, "n": 300}
    )
    frames = [
        pamqp_frame.marshal(spec.Basic.Deliver("ctag", 200, False, "ex", "orders.created"), 3),
        pamqp_frame.marshal(pamqp_header.ContentHeader(0, 2, properties), 3),
        pamqp_frame.marshal(pamqp_body.ContentBody(b"{}"), 3),
        pamqp_frame.marshal(Heartbeat(), 0),
        pamqp_frame.marshal(spec.Basic.Ack(delivery_tag=5), 2),
        get_ok(b"orders.created"),
    ]
    stream = asyncio.StreamReader()
    stream.feed_data(b"".join(frames))
    stream.feed_eof()
    reader = LenientFrameReader(stream)
    read_back = []
    for _ in frames:
        head = await reader.readexactly(1) + await reader.readexactly(6)
        read_back.append(head + await reader.readexactly(int.from_bytes(head[3:7]) + 1))
    assert read_back == frames
    assert reader.at_eof()


@pytest.mark.parametrize("make", [FrameReceiver, FastFrameReceiver])
@pytest.mark.parametrize("piece", [1, 5, 7, 13, 64, 100_000])
async def test_frames_split_across_socket_reads_arrive_whole_and_checked(piece: int, make: Any) -> None:
    # The reader reads the socket in chunks; a frame may end in the next one, a body in a later one.
    big_body = bytes(range(256)) * 40
    frames = [
        pamqp_frame.marshal(spec.Basic.Deliver("ctag", 1, False, "ex", "orders.created"), 1),
        pamqp_frame.marshal(pamqp_header.ContentHeader(0, len(big_body), LilyProperties(headers={"n": 1})), 1),
        pamqp_frame.marshal(pamqp_body.ContentBody(big_body), 1),
        pamqp_frame.marshal(Heartbeat(), 0),
        deliver(b"orders.\xff", tag=2),
        content_header(b"\x00\x00", body_size=2),
        pamqp_frame.marshal(pamqp_body.ContentBody(b"{}"), 1),
    ]
    data = b"".join(frames)
    stream = asyncio.StreamReader()

    async def feed() -> None:
        for start in range(0, len(data), piece):
            stream.feed_data(data[start : start + piece])
            await asyncio.sleep(0)
        stream.feed_eof()

    feeding = asyncio.create_task(feed())
    receiver = make(LenientFrameReader(stream))
    received = [await receiver.get_frame() for _ in frames]
    await feeding
    assert received[2][2].value == big_body
    assert isinstance(received[3][2], Heartbeat)
    assert received[4][2].routing_key == "orders.\ufffd"
    assert MALFORMED_HEADER in received[5][2].properties.headers
    assert received[6][2].value == b"{}"


async def test_an_undecodable_header_name_arrives_readable_and_marked() -> None:
    headers = raw_table([*ENVELOPE, (b"x-\xff\xfe", long_string_value("v"))])
    data = content_header(raw_properties(content_type=b"application/json", headers=headers), body_size=2)
    data += wire(1, 3, b"{}")
    (_, header), (_, body) = await receive(data, 2)
    assert isinstance(header, pamqp_header.ContentHeader)
    assert header.body_size == 2
    assert header.properties.content_type == "application/json"
    assert header.properties.headers == {
        "x-lily-event-id": EVENT_ID,
        "x-lily-schema-version": "1",
        "x-lily-content-kind": "json",
        "x-\ufffd\ufffd": "v",
        MALFORMED_HEADER: "a header name is not valid UTF-8",
    }
    assert isinstance(body, pamqp_body.ContentBody)
    assert body.value == b"{}"


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"content_type": b"text/\xff"}, "property content_type is not valid UTF-8"),
        ({"message_id": b"id-\xc3"}, "property message_id is not valid UTF-8"),
        ({"message_type": b"\xe9v\xe9nement"}, "property type is not valid UTF-8"),
        (
            {"headers": raw_table([(b"meta", b"F" + raw_table([(b"\x80", b"t\x01")]))])},
            "a nested header name in 'meta' is not valid UTF-8",
        ),
        (
            {"headers": raw_table([(b"list", b"A" + (9).to_bytes(4) + b"F" + raw_table([(b"\xff", b"t\x01")]))])},
            "a nested header name in 'list' is not valid UTF-8",
        ),
    ],
)
async def test_every_undecodable_short_string_is_named(fields: dict[str, bytes], reason: str) -> None:
    [(_, header)] = await receive(content_header(raw_properties(**fields)), 1)  # type: ignore[arg-type]
    assert header.properties.headers[MALFORMED_HEADER] == reason


async def test_properties_that_cannot_be_parsed_keep_only_the_mark_and_the_body_size() -> None:
    # The flags announce a header table whose length runs past the frame.
    data = content_header((1 << 13).to_bytes(2) + (500).to_bytes(4) + b"\x01k", body_size=3)
    [(_, header)] = await receive(data, 1)
    assert header.body_size == 3
    assert header.properties.headers == {MALFORMED_HEADER: "the message properties cannot be parsed"}
    assert header.properties.content_type is None


async def test_an_undecodable_routing_key_marks_the_content_header_that_follows_on_its_channel() -> None:
    plain = raw_properties(content_type=b"application/json", headers=raw_table(ENVELOPE))
    data = deliver(b"orders.\xff", tag=300, channel=1) + deliver(b"orders", tag=5, channel=2)
    data += content_header(plain, channel=2) + content_header(plain, channel=1)
    (_, first), (_, second), (_, on_two), (_, on_one) = await receive(data, 4)
    assert isinstance(first, spec.Basic.Deliver)
    assert (first.routing_key, first.delivery_tag, first.redelivered, first.consumer_tag) == (
        "orders.\ufffd",
        300,
        True,
        "ctag-1",
    )
    assert second.routing_key == "orders"
    assert MALFORMED_HEADER not in on_two.properties.headers
    assert on_one.properties.headers[MALFORMED_HEADER] == "the routing key is not valid UTF-8"
    assert on_one.properties.headers["x-lily-event-id"] == EVENT_ID


async def test_a_basic_get_answer_with_an_undecodable_routing_key_is_readable() -> None:
    [(_, answer)] = await receive(get_ok(b"\xfe\xff", tag=9, count=41), 1)
    assert isinstance(answer, spec.Basic.GetOk)
    assert (answer.delivery_tag, answer.exchange, answer.routing_key, answer.message_count) == (
        9,
        "amq.direct",
        "\ufffd\ufffd",
        41,
    )


async def test_the_brokers_protocol_header_still_ends_the_handshake() -> None:
    with pytest.raises(aiormq.exceptions.ProtocolSyntaxError):
        await receive(b"AMQP\x00\x00\x09\x01", 1)


async def test_only_lenient_connections_get_lilys_receiver() -> None:
    # aiormq builds every connection's receiver through the module global.
    assert patches.active() == "fast"  # the installed aiormq and pamqp are the tested ones
    choice = aiormq.connection.FrameReceiver
    assert choice is not FrameReceiver
    assert issubclass(choice, FrameReceiver)  # type checks against the global still hold
    reader = LenientFrameReader(asyncio.StreamReader())
    lenient = aiormq.connection.FrameReceiver(reader)  # type: ignore[arg-type]
    plain = aiormq.connection.FrameReceiver(asyncio.StreamReader())
    assert type(lenient) is FastFrameReceiver
    assert reader.receiver == "fast"
    assert isinstance(plain, FrameReceiver)
    assert type(plain).__mro__[1:] == FrameReceiver.__mro__  # aiormq's receiver, nothing added
    assert plain.reader is not None  # aiormq's __init__ ran
    assert not plain.started


@pytest.fixture
def untested_aiormq(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with untested(monkeypatch, "aiormq"):
        yield


@pytest.mark.usefixtures("untested_aiormq")
async def test_outside_the_tested_versions_a_lenient_connection_gets_aiormqs_receiver(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="lily_mongo")
    reader = LenientFrameReader(asyncio.StreamReader())
    receiver = aiormq.connection.FrameReceiver(reader)  # type: ignore[arg-type]
    assert type(receiver) is not FastFrameReceiver
    assert isinstance(receiver, FrameReceiver)
    assert reader.receiver == "stock"
    channel = types.SimpleNamespace(frames=asyncio.Queue(maxsize=10))
    unbounded_frame_queue(channel)  # type: ignore[arg-type]
    assert channel.frames.maxsize == 10
    assert patches.active() == "stock"
    said = [r.getMessage() for r in caplog.records if r.name == "lily_mongo"]
    assert len(said) == 1, said
    assert "aiormq 8.0.0" in said[0]
    assert caplog.records[0].levelname == "INFO"


@pytest.mark.usefixtures("untested_aiormq")
async def test_the_stock_receiver_still_reads_leniently() -> None:
    data = deliver(b"orders.\xff", tag=4) + content_header(raw_properties(headers=raw_table(ENVELOPE)))
    stream = asyncio.StreamReader()
    stream.feed_data(data)
    stream.feed_eof()
    receiver = aiormq.connection.FrameReceiver(LenientFrameReader(stream))  # type: ignore[arg-type]
    (_, _, method), (_, _, header) = [await receiver.get_frame() for _ in range(2)]
    assert isinstance(method, spec.Basic.Deliver)
    assert isinstance(header, pamqp_header.ContentHeader)
    assert method.routing_key == "orders.\ufffd"
    assert header.properties.headers is not None
    assert header.properties.headers[MALFORMED_HEADER] == "the routing key is not valid UTF-8"


def test_an_inbound_message_takes_the_mark_out_of_its_headers() -> None:
    headers: FieldTable = {"x-lily-event-id": EVENT_ID, MALFORMED_HEADER: "a header name is not valid UTF-8"}
    delivered = aiormq.abc.DeliveredMessage(
        delivery=spec.Basic.Deliver("ctag", 1, False, "", "q"),
        header=pamqp_header.ContentHeader(0, 0, spec.Basic.Properties(headers=headers)),
        body=b"",
        channel=None,  # type: ignore[arg-type]
    )
    message = AmqpMessage(delivered)
    assert message.malformed == "a header name is not valid UTF-8"
    assert message.headers == {"x-lily-event-id": EVENT_ID}


def test_an_ordinary_inbound_message_is_not_marked() -> None:
    delivered = aiormq.abc.DeliveredMessage(
        delivery=spec.Basic.Deliver("ctag", 1, False, "", "q"),
        header=pamqp_header.ContentHeader(0, 0, spec.Basic.Properties(headers={"k": "v"})),
        body=b"",
        channel=None,  # type: ignore[arg-type]
    )
    assert AmqpMessage(delivered).malformed is None


def test_an_inbound_message_reads_its_other_properties_from_the_frame() -> None:
    stamp = datetime.datetime(2024, 5, 1, 12, 30, tzinfo=datetime.UTC)
    properties = spec.Basic.Properties(
        content_encoding="gzip", correlation_id="c-1", reply_to="answers", app_id="shop", priority=7
    )
    properties.timestamp, properties.message_type, properties.message_id, properties.user_id = stamp, "t", "m", "u"
    header = pamqp_header.ContentHeader(0, 0, properties)
    message = AmqpMessage(aiormq.abc.DeliveredMessage(spec.Basic.Deliver("ctag", 2), header, b"", None))  # type: ignore[arg-type]
    assert (message.content_encoding, message.correlation_id, message.reply_to) == ("gzip", "c-1", "answers")
    assert (message.app_id, message.priority, message.timestamp) == ("shop", 7, stamp)
    assert (message.type, message.message_id, message.user_id) == ("t", "m", "u")
    with pytest.raises(AttributeError):
        message.user_id = "someone else"  # type: ignore[misc]


async def test_a_consuming_channels_frame_queue_is_unbounded() -> None:
    # aio-pika opens aiormq channels with a 10-frame queue; lily lifts the bound on the
    # channels it consumes from (the prefetch bounds what arrives).
    channel = types.SimpleNamespace(frames=asyncio.Queue(maxsize=10))
    unbounded_frame_queue(channel)  # type: ignore[arg-type]
    for n in range(1000):
        channel.frames.put_nowait(n)
    assert channel.frames.maxsize == 0
    assert not channel.frames.full()
