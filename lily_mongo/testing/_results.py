"""What a test consumer records: each delivery's result, each message it would have published."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .._headers import EVENT_ID_HEADER
from .._snapshots import TerminalObservation
from .._text import truncate_utf8
from ._writes import SessionlessWrite, outside_session_hint

if TYPE_CHECKING:
    pass


_EXCEPTION_REPR_BYTES = 160  # the exception in a DeliveryResult's repr


_SETTLED = frozenset({"acked", "duplicate", "retried", "dead_lettered", "broker_dead_lettered"})


@dataclass(frozen=True, slots=True)
class PublishedMessage:
    """A message the consumer would have published: a retry or DLQ copy, or an outbox message."""

    kind: Literal["retry", "dlq", "outbox"]
    exchange: str
    routing_key: str
    headers: Mapping[str, Any]
    body: bytes
    content_type: str | None

    @property
    def event_id(self) -> str | None:
        value = self.headers.get(EVENT_ID_HEADER)
        return value if isinstance(value, str) else None


@dataclass(frozen=True, slots=True)
class DeliveryResult:
    """How one in-process delivery ended: its terminal ``outcome``, failure ``code`` and ``exception``."""

    observation: TerminalObservation
    settlement: str | None  # the settlement written: "ack", "nack_requeue", "reject" or None
    exception: BaseException | None = None
    """What the handler (or its middleware, guards or factories) raised on the last attempt, or None."""
    outside_session: tuple[SessionlessWrite, ...] = ()
    """The writes of this delivery's handler (under the inbox) made outside ``mongo.session``."""

    def __repr__(self) -> str:
        # One short line, so that a failed ``assert result.outcome == "acked"`` shows the cause.
        shown = "None" if self.exception is None else truncate_utf8(repr(self.exception), _EXCEPTION_REPR_BYTES)
        code = None if self.code is None else str(self.code)  # a plain string, not an ErrorCode member
        hint = f", hint={self.hint!r}" if self.hint else ""
        return f"DeliveryResult(outcome={self.outcome!r}, code={code!r}, exception={shown}{hint})"

    @property
    def hint(self) -> str:
        """The likely cause of a failure the handler's code made, when the command log shows one; else ''."""
        return outside_session_hint(list(self.outside_session))

    @property
    def outcome(self) -> str:
        """A :class:`~lily_mongo.settlement.Terminal` value: acked, duplicate, retried, dead_lettered, ..."""
        return self.observation.outcome

    @property
    def code(self) -> str | None:
        return self.observation.code

    @property
    def reason(self) -> str:
        return self.observation.reason

    @property
    def event_id(self) -> uuid.UUID | None:
        return self.observation.event_id
