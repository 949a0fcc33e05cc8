"""AMQP wire details the rest of the package relies on.

* :class:`LilyProperties` encodes ``x-retry-count`` as AMQP LongInt (type tag
  ``I``) whatever its value. pamqp picks the narrowest integer type for table
  values (``b`` for 0..127) and offers no per-value choice; overriding the
  header table encoding on this one properties subclass keeps every other
  value, and every other publisher in the process, on pamqp's defaults.
* :func:`basic_publish` is the one place that publishes: mandatory, confirmed,
  bounded by a timeout, with aiormq's errors mapped to :class:`PublishError`.
* :class:`InboundMessage` is one consumed delivery as the runtime reads and
  settles it, built straight from aiormq's delivered frame.
"""

from __future__ import annotations

import asyncio
import struct
import uuid
from collections.abc import Mapping
from typing import Any

import aio_pika.abc
import aiormq
import aiormq.abc
import aiormq.exceptions
from pamqp import commands as spec
from pamqp import common, encode

from .bounds import RETRY_COUNT_HEADER
from .errors import PublishError

__all__ = [
    "LONG_INT_HEADERS",
    "InboundMessage",
    "LilyProperties",
    "basic_publish",
    "encode_headers_table",
    "republish",
]

# Headers always written as signed 32-bit LongInt (SPEC section 2).
LONG_INT_HEADERS: frozenset[str] = frozenset({RETRY_COUNT_HEADER})
_LONG_INT = struct.Struct(">i")


def _field_value(value: Any) -> Any:
    """pamqp encodes byte arrays from ``bytearray`` only; ``bytes`` (what MongoDB and most
    callers hand back) becomes a byte array too, nested values included."""
    if isinstance(value, bytes):
        return bytearray(value)
    if isinstance(value, dict):
        return {k: _field_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_field_value(v) for v in value]
    return value


def encode_headers_table(headers: Mapping[str, Any]) -> bytes:
    """Encode an AMQP field table like pamqp does, but LongInt for :data:`LONG_INT_HEADERS`."""
    if not headers:
        return common.Struct.integer.pack(0)
    parts: list[bytes] = []
    for key, value in sorted(headers.items()):
        parts.append(encode.short_string(key))
        if key in LONG_INT_HEADERS and type(value) is int:
            parts.append(b"I" + _LONG_INT.pack(value))
        elif isinstance(value, bytes | dict | list | tuple):
            parts.append(encode.encode_table_value(_field_value(value)))
        else:
            parts.append(encode.encode_table_value(value))
    payload = b"".join(parts)
    return common.Struct.integer.pack(len(payload)) + payload


class LilyProperties(spec.Basic.Properties):
    """Basic.Properties whose header table writes ``x-retry-count`` as LongInt."""

    def encode_property(self, name: str, value: common.FieldValue) -> bytes:
        if name == "headers" and isinstance(value, dict):
            return encode_headers_table(value)
        return super().encode_property(name, value)


async def basic_publish(
    channel: aiormq.abc.AbstractChannel,
    *,
    exchange: str,
    routing_key: str,
    body: bytes,
    headers: Mapping[str, Any],
    content_type: str | None,
    timeout: float,
    persistent: bool = True,
    expiration: str | None = None,
    properties: Mapping[str, Any] | None = None,
) -> None:
    """Publish mandatory on a confirming channel; return only once the broker confirmed.

    Raises :class:`PublishError` with kind ``unroutable`` (basic.return),
    ``nacked`` (basic.nack), ``timeout`` (no confirm in ``timeout`` seconds) or
    ``closed`` (the channel or connection failed).
    """
    frame_properties = LilyProperties(
        **(properties or {}),
        content_type=content_type,
        headers=dict(headers),
        delivery_mode=2 if persistent else 1,
        # A fresh id per publication: aiormq matches basic.return frames to
        # publishes by message_id, so copies of one event must not share it.
        message_id=uuid.uuid4().hex,
        expiration=expiration,
    )
    where = f"exchange {exchange!r} routing key {routing_key!r}"
    try:
        frame_properties.marshal()  # encode now, so a bad header fails here, not in the writer
    except (TypeError, ValueError) as exc:
        raise PublishError("invalid", f"{where}: the message cannot be encoded as AMQP: {exc}"[:300]) from exc
    try:
        confirmation = await channel.basic_publish(
            body,
            exchange=exchange,
            routing_key=routing_key,
            properties=frame_properties,
            mandatory=True,
            timeout=timeout,
        )
    except aiormq.exceptions.PublishError as exc:
        raise PublishError("unroutable", f"{where}: returned by the broker as unroutable") from exc
    except aiormq.exceptions.DeliveryError as exc:
        raise PublishError("nacked", f"{where}: the broker nacked the message") from exc
    except TimeoutError as exc:
        raise PublishError("timeout", f"{where}: no publisher confirm within {timeout:g} s") from exc
    except (aiormq.exceptions.AMQPError, ConnectionError, asyncio.InvalidStateError, RuntimeError) as exc:
        raise PublishError("closed", f"{where}: channel failed ({type(exc).__name__})") from exc
    if not isinstance(confirmation, spec.Basic.Ack):
        raise PublishError("nacked", f"{where}: no publisher confirm (got {type(confirmation).__name__})")


class InboundMessage:
    """One consumed delivery: the fields the pipeline reads, and its settlement on its own channel.

    Built from aiormq's delivered frame in the consumer callback. aio-pika's
    ``IncomingMessage`` would set some thirty attributes through a Python
    ``__setattr__`` and run each callback in a second task; on a busy queue that
    costs about as much CPU as the whole delivery pipeline. The values are the
    same ones aio-pika exposes (headers, timestamp, ... as pamqp decoded them).
    A delivery is settled at most once: a second ACK/NACK/reject raises.
    """

    __slots__ = (
        "_properties",
        "_settled",
        "body",
        "channel",
        "content_type",
        "delivery_tag",
        "exchange",
        "headers",
        "redelivered",
        "routing_key",
    )

    def __init__(self, delivered: aiormq.abc.DeliveredMessage) -> None:
        properties = delivered.header.properties
        delivery = delivered.delivery
        assert isinstance(delivery, spec.Basic.Deliver)
        self._properties = properties
        self._settled = False
        self.body: bytes = delivered.body
        self.channel: aiormq.abc.AbstractChannel = delivered.channel
        self.content_type: str | None = properties.content_type
        self.delivery_tag: int = delivery.delivery_tag or 0
        self.exchange: str = delivery.exchange or ""
        self.headers: dict[str, Any] = properties.headers or {}
        self.redelivered: bool = bool(delivery.redelivered)
        self.routing_key: str = delivery.routing_key or ""

    def __repr__(self) -> str:
        return f"<InboundMessage tag={self.delivery_tag} routing_key={self.routing_key!r} body={len(self.body)} bytes>"

    # Read only on failure paths (handoff copies, failure keys): straight from the frame.
    @property
    def message_id(self) -> str | None:
        return self._properties.message_id

    @property
    def correlation_id(self) -> str | None:
        return self._properties.correlation_id

    @property
    def reply_to(self) -> str | None:
        return self._properties.reply_to

    @property
    def app_id(self) -> str | None:
        return self._properties.app_id

    @property
    def content_encoding(self) -> str | None:
        return self._properties.content_encoding

    @property
    def priority(self) -> int | None:
        return self._properties.priority

    @property
    def timestamp(self) -> Any:
        return self._properties.timestamp

    @property
    def type(self) -> str | None:
        return self._properties.message_type

    def _claim(self, what: str) -> None:
        if self._settled:
            raise RuntimeError(f"delivery {self.delivery_tag} is already settled; refusing a second {what}")
        self._settled = True

    async def ack(self) -> None:
        self._claim("ack")
        await self.channel.basic_ack(self.delivery_tag)

    async def nack(self, *, requeue: bool = True) -> None:
        self._claim("nack")
        await self.channel.basic_nack(self.delivery_tag, requeue=requeue)

    async def reject(self, *, requeue: bool = False) -> None:
        self._claim("reject")
        await self.channel.basic_reject(self.delivery_tag, requeue=requeue)


# Properties a copy keeps from the original. Not message_id (a fresh one is
# needed, see above), not expiration (a retry copy must not expire on the way),
# not user_id (the broker checks it against the publishing connection's user).
_COPIED_PROPERTIES = ("correlation_id", "reply_to", "app_id", "content_encoding", "priority", "timestamp", "type")


async def republish(
    channel: aiormq.abc.AbstractChannel,
    message: aio_pika.abc.AbstractIncomingMessage | InboundMessage,
    *,
    routing_key: str,
    headers: Mapping[str, Any],
    timeout: float,
) -> None:
    """Publish a copy of ``message`` (same body and properties, given headers) through the default
    exchange to ``routing_key``, mandatory and confirmed: the retry/DLQ handoff and the DLQ replay."""
    kept = {name: getattr(message, name) for name in _COPIED_PROPERTIES if getattr(message, name, None) is not None}
    if "type" in kept:
        kept["message_type"] = kept.pop("type")
    await basic_publish(
        channel,
        exchange="",
        routing_key=routing_key,
        body=message.body,
        headers=headers,
        content_type=message.content_type,
        timeout=timeout,
        properties=kept,
    )
