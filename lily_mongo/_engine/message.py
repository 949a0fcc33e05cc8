"""What the engine reads and settles of one delivery, whatever transport it came by.

An :class:`InboundMessage` is the AMQP adapter's message (:class:`lily_mongo._amqp.AmqpMessage`)
or an in-process transport's (:class:`lily_mongo.testing.TestConsumer`'s). Each settlement
method is called at most once per message; the handler never sees one (it gets a
:class:`~lily_mongo.RawDelivery`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

__all__ = ["ChannelState", "Handoff", "InboundMessage"]


class ChannelState(Protocol):
    """The channel a message came on: once it is closed, its deliveries have no settlement authority."""

    @property
    def is_closed(self) -> bool: ...


class InboundMessage(Protocol):
    """One received message: what preparing reads, and the settlement it gets (docs/settlement.md)."""

    @property
    def headers(self) -> dict[str, Any]: ...
    @property
    def body(self) -> bytes: ...
    @property
    def content_type(self) -> str | None: ...
    @property
    def redelivered(self) -> bool: ...
    @property
    def routing_key(self) -> str: ...
    @property
    def exchange(self) -> str: ...
    @property
    def malformed(self) -> str | None:
        """None, or which metadata was not valid AMQP text (the transport read it leniently)."""
        ...

    @property
    def message_id(self) -> str | None: ...
    @property
    def channel(self) -> ChannelState: ...
    async def ack(self) -> None: ...
    async def nack(self, *, requeue: bool = True) -> None: ...
    async def reject(self, *, requeue: bool = False) -> None: ...


Handoff = Callable[[InboundMessage, str, Mapping[str, Any]], Awaitable[None]]
"""``handoff(message, routing_key, headers)``: publish a retry or DLQ copy of ``message``,
mandatory and confirmed, raising :class:`~lily_mongo.PublishError` unless the destination accepted it."""
