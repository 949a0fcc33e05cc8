"""Messages as the engine reads them, for the unit tier's calls into preparing."""

from __future__ import annotations

from lily_mongo._engine.message import ChannelState


class Unsettled:
    """The settlement half of an ``InboundMessage`` for a message that is only read: preparing
    reads a delivery's headers, body and properties and settles nothing, so any settlement fails
    the test. A test's message class adds the fields it reads."""

    message_id: str | None = None

    @property
    def channel(self) -> ChannelState:
        raise AssertionError("preparing reads no channel")

    async def ack(self) -> None:
        raise AssertionError("preparing settles nothing (ack)")

    async def nack(self, *, requeue: bool = True) -> None:
        raise AssertionError("preparing settles nothing (nack)")

    async def reject(self, *, requeue: bool = False) -> None:
        raise AssertionError("preparing settles nothing (reject)")
