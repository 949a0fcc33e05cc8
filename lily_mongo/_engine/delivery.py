"""One admitted delivery's state in the engine, and the stages it moves through (docs/lifecycle.md, section 5)."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import hashlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

from .._observer import NO_DELIVERY, DeliveryObserver
from .._verdicts import Execution
from ..envelope import Envelope
from .barrier import SettleBarrier
from .message import InboundMessage
from .queues import QueueState

__all__ = ["CUT_OFF", "DROPPED", "EXECUTING", "FINISHED", "RECEIVED", "SETTLING", "Delivery", "Stage", "failure_key"]


class Stage(enum.Enum):
    """Where one delivery is; each stage only ever moves forward (docs/lifecycle.md, section 5).

    ``RECEIVED`` → ``EXECUTING`` → ``SETTLING`` → ``FINISHED`` is the usual path (a
    delivery refused while preparing goes straight to ``SETTLING``). Past its deadline an
    execution is ``CUT_OFF``: it was cancelled, and either ends within the cooperation window
    (``SETTLING``, in its own task) or is ``DROPPED`` and settled from another task. After a
    forced shutdown any stage may jump to ``FINISHED``, recorded unresolved.
    """

    RECEIVED = 0  # admitted: envelope, handler and payload are being prepared
    EXECUTING = 1  # the handler runs, under the delivery deadline
    CUT_OFF = 2  # past the deadline: its task was cancelled, the cooperation window runs
    SETTLING = 3  # the execution has its verdict: the delivery's own task settles it
    DROPPED = 4  # the handler ignored the cancellation: another task settles the delivery
    FINISHED = 5  # its permit came back and its terminal outcome was recorded


# The hot path reads these as globals (an enum member's attribute lookup costs more).
RECEIVED, EXECUTING, CUT_OFF, SETTLING, DROPPED, FINISHED = Stage


@dataclass(slots=True, eq=False)
class Delivery:
    """One admitted delivery's state: shared by its worker, the deadline sweeper and, once
    dropped, the task that settles it."""

    qs: QueueState
    message: InboundMessage
    received_at: float = dataclasses.field(default_factory=time.time)
    started: float = dataclasses.field(default_factory=time.monotonic)
    stage: Stage = Stage.RECEIVED
    envelope: Envelope | None = None
    handler_id: str | None = None
    execution: Execution | None = None
    executing_since: float = 0.0  # time.monotonic() when the execution started (its deadline counts from it)
    settle_task: asyncio.Task[Any] | None = None  # set once dropped: the task settling it instead of its own
    failure_key: bytes = b""
    trace: DeliveryObserver = NO_DELIVERY
    event_id: uuid.UUID | None = None  # a refused delivery's event id (its header was valid); else the envelope's
    barrier: SettleBarrier | None = None  # a batch member's: its ACK waits for the batch's (docs/handlers.md)


def failure_key(message: InboundMessage, envelope: Envelope | None) -> bytes:
    """Identity of a delivery across redeliveries, for the handoff-failure and deferral counters."""
    if envelope is not None:
        return envelope.event_id.bytes
    digest = hashlib.blake2b(message.body, digest_size=16)
    digest.update(message.routing_key.encode())
    digest.update((message.message_id or "").encode())
    return digest.digest()
