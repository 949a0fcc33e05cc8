"""Which ACK frames settle a channel's ACK-marked deliveries: the coalescing decision, pure.

A consuming channel's deliveries are numbered 1, 2, 3, ... by the broker (the
delivery tag). ``basic.ack(multiple=True, delivery_tag=N)`` settles every
delivery of the channel up to N that the broker still holds unacknowledged, and
RabbitMQ closes the channel (PRECONDITION_FAILED, "unknown delivery tag") when N
itself is not one of them. So one frame may stand for a run of deliveries only
when every tag of the run is known here and either ACK-marked or settled
already, and the frame names the highest ACK-marked tag of the run.

:func:`plan_flush` takes the channel's ledger: ``floor`` (every tag up to it is
settled or covered by a frame already written) and the state of each tag above
it that was delivered here. It answers with the frames to write, in order, and
the new ledger. Tags never seen here (a gap in the numbering) count as unsettled:
a multiple ACK never reaches past one. The I/O that writes the frames is
:class:`lily_mongo._amqp.coalescer.AckCoalescer`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["AckFlush", "TagState", "plan_flush"]


class TagState(enum.IntEnum):
    """Where one delivery of the channel stands."""

    OUTSTANDING = 0  # delivered, not settled: no ACK may cover it
    MARKED = 1  # its settlement is ACK; no frame written for it yet
    SETTLED = 2  # a frame for it was written on its own (ACK, NACK or reject)


@dataclass(frozen=True, slots=True)
class AckFlush:
    """The frames of one flush, in write order, and the ledger after them."""

    multiple: int | None  # ack(multiple=True) up to this tag: every tag of the run at or below it
    single: tuple[int, ...]  # ack(multiple=False) for each; the run's frame if it covers one tag
    floor: int  # the new floor: every tag at or below it is settled
    covered: tuple[int, ...]  # every ACK-marked tag these frames settle, ascending


def plan_flush(floor: int, tags: Mapping[int, TagState], *, forced: bool) -> AckFlush:
    """The frames that settle the ACK-marked tags of one channel.

    The run is the longest sequence ``floor + 1, floor + 2, ...`` of tags that are
    all MARKED or SETTLED; its MARKED tags are settled by one frame naming the
    highest of them (``multiple`` when it stands for more than one, else one
    ``single``). With ``forced``, every MARKED tag above the run (blocked behind a
    delivery still outstanding) gets a single ACK as well. ``tags`` is not changed;
    the caller applies the answer: tags up to ``floor`` leave the ledger and the
    other ``covered`` tags become SETTLED.
    """
    run_end = floor
    top = 0  # the run's highest MARKED tag
    in_run: list[int] = []
    tag = floor + 1
    state = tags.get(tag)
    while state is not None and state is not TagState.OUTSTANDING:
        if state is TagState.MARKED:
            top = tag
            in_run.append(tag)
        run_end = tag
        tag += 1
        state = tags.get(tag)
    blocked: list[int] = []
    if forced:
        blocked = sorted(t for t, s in tags.items() if s is TagState.MARKED and t > run_end)
    if not in_run and not blocked:
        return AckFlush(None, (), run_end, ())
    multiple = top if len(in_run) > 1 else None
    single = (top, *blocked) if len(in_run) == 1 else tuple(blocked)
    return AckFlush(multiple, single, run_end, (*in_run, *blocked))
