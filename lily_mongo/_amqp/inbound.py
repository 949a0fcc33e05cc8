"""One consumed delivery as the engine reads and settles it: :class:`AmqpMessage`."""

from __future__ import annotations

import operator
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Self, overload

import aiormq.abc
from pamqp import commands as spec

from .coalescer import AckCoalescer
from .codec import PROPERTY_NAMES
from .lenient import MALFORMED_HEADER
from .properties import LilyProperties

__all__ = ["AmqpMessage"]


class _FromFrame[T]:
    """A property of the delivery, read from its frame's decoded properties (the attribute ``name``) when
    asked for: only the failure paths and the DLQ tools ask, so the constructor copies none."""

    __slots__ = ("_read",)

    def __init__(self, name: str) -> None:
        self._read = operator.attrgetter(f"_properties.{name}")

    @overload
    def __get__(self, message: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(self, message: AmqpMessage, owner: type[Any]) -> T: ...
    def __get__(self, message: AmqpMessage | None, owner: type[Any]) -> Self | T:
        if message is None:
            return self
        value: T = self._read(message)
        return value


class AmqpMessage:
    """One consumed delivery: the fields the pipeline reads, and its settlement on its own channel.

    Built from aiormq's delivered frame in the consumer callback. aio-pika's
    ``IncomingMessage`` would set some thirty attributes through a Python
    ``__setattr__`` and run each callback in a second task; on a busy queue that
    costs about as much CPU as the whole delivery pipeline. The values are the
    same ones aio-pika exposes (headers, timestamp, ... as pamqp decoded them).
    A delivery is settled at most once: a second ACK/NACK/reject raises. Given the
    :class:`AckCoalescer` of its channel, it settles through it (its ACK may then
    share a frame with others); otherwise each settlement is a frame of its own.

    ``malformed`` is ``None``, or says which part of the delivery's metadata was not
    valid AMQP when it arrived (see :class:`LenientFrameReader`); the fields then
    hold the lenient reading, and the delivery is refused before anything else.
    Built from a ``basic.deliver`` (consuming) or a ``basic.get-ok`` (the DLQ tools).
    """

    __slots__ = (
        "_acks",
        "_properties",
        "_settled",
        "body",
        "channel",
        "content_type",
        "delivery_tag",
        "exchange",
        "headers",
        "malformed",
        "redelivered",
        "routing_key",
    )

    def __init__(self, delivered: aiormq.abc.DeliveredMessage, acks: AckCoalescer | None = None) -> None:
        properties = delivered.header.properties
        delivery = delivered.delivery
        assert isinstance(delivery, spec.Basic.Deliver | spec.Basic.GetOk)
        self._properties = properties
        self._settled = False
        self.body: bytes = delivered.body
        self.channel: aiormq.abc.AbstractChannel = delivered.channel
        self.content_type: str | None = properties.content_type
        self.delivery_tag: int = delivery.delivery_tag or 0
        self.exchange: str = delivery.exchange or ""
        headers: dict[str, Any] = properties.headers or {}
        self.headers = headers
        # The lenient reader's mark: a key no producer can know (see MALFORMED_HEADER).
        self.malformed: str | None = headers.pop(MALFORMED_HEADER, None)
        self.redelivered: bool = bool(delivery.redelivered)
        self.routing_key: str = delivery.routing_key or ""
        # Only the coalescer of this very channel: a delivery never settles on another one.
        if acks is not None and acks.channel is delivered.channel:
            acks.delivered(self.delivery_tag)
            self._acks: AckCoalescer | None = acks
        else:
            self._acks = None

    def __repr__(self) -> str:
        return f"<AmqpMessage tag={self.delivery_tag} routing_key={self.routing_key!r} body={len(self.body)} bytes>"

    # Read only on failure paths (handoff copies, failure keys): straight from the frame.
    message_id = _FromFrame[str | None]("message_id")
    correlation_id = _FromFrame[str | None]("correlation_id")
    reply_to = _FromFrame[str | None]("reply_to")
    app_id = _FromFrame[str | None]("app_id")
    content_encoding = _FromFrame[str | None]("content_encoding")
    priority = _FromFrame[int | None]("priority")
    timestamp = _FromFrame[Any]("timestamp")
    type = _FromFrame[str | None]("message_type")
    user_id = _FromFrame[str | None]("user_id")

    def properties_with(self, headers: Mapping[str, Any], *, drop: tuple[str, ...] = ()) -> LilyProperties:
        """Every AMQP property of this delivery as it arrived, with ``headers`` as the header table
        and the properties named in ``drop`` left out (for a faithful copy of the message)."""
        values = {name: getattr(self._properties, name) for name in PROPERTY_NAMES}
        values["headers"] = dict(headers)
        for name in drop:
            values[name] = None
        values["cluster_id"] = values.get("cluster_id") or ""  # pamqp encodes only an empty one
        return LilyProperties(**values)

    def _claim(self, what: str) -> None:
        if self._settled:
            raise RuntimeError(f"delivery {self.delivery_tag} is already settled; refusing a second {what}")
        self._settled = True

    async def ack(self) -> None:
        """ACK; returns once a frame settling this delivery was written."""
        self._claim("ack")
        if self._acks is not None:
            await self._acks.ack(self.delivery_tag)
        else:
            await self.channel.basic_ack(self.delivery_tag)

    async def nack(self, *, requeue: bool = True) -> None:
        self._claim("nack")
        await self._alone(lambda: self.channel.basic_nack(self.delivery_tag, requeue=requeue))

    async def reject(self, *, requeue: bool = False) -> None:
        self._claim("reject")
        await self._alone(lambda: self.channel.basic_reject(self.delivery_tag, requeue=requeue))

    def _alone(self, write: Callable[[], Awaitable[None]]) -> Awaitable[None]:
        """A NACK or reject (``write`` writes it) in a frame of its own: through the coalescer, after its
        pending ACKs, when there is one."""
        if self._acks is not None:
            return self._acks.alone(self.delivery_tag, write)
        return write()
