"""The in-process transport: a message as a test consumer delivers it, on a channel that never closes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


class _OpenChannel:
    is_closed = False


@dataclass(slots=True, eq=False)
class InProcessMessage:
    """One in-process delivery, settled at most once like an AMQP one."""

    queue: str
    headers: dict[str, Any]
    body: bytes
    content_type: str | None = None
    redelivered: bool = False
    exchange: str = ""
    message_id: str | None = None
    malformed: str | None = None
    channel: _OpenChannel = dataclasses.field(default_factory=_OpenChannel)
    settled: str | None = None

    @property
    def routing_key(self) -> str:
        return self.queue

    def _settle(self, how: str) -> None:
        if self.settled is not None:
            raise RuntimeError(f"delivery already settled with {self.settled}; refusing {how}")
        self.settled = how

    async def ack(self) -> None:
        self._settle("ack")

    async def nack(self, *, requeue: bool = True) -> None:
        self._settle("nack_requeue" if requeue else "reject")

    async def reject(self, *, requeue: bool = False) -> None:
        self._settle("nack_requeue" if requeue else "reject")
