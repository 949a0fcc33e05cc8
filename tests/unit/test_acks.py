"""The coalescing decision: which ACK frames settle a channel's ACK-marked deliveries."""

from __future__ import annotations

from lily_mongo._amqp.acks import AckFlush, TagState, plan_flush

OUT, M, S = TagState.OUTSTANDING, TagState.MARKED, TagState.SETTLED


def ledger(*states: TagState, floor: int = 0) -> dict[int, TagState]:
    return {floor + 1 + i: state for i, state in enumerate(states)}


def test_a_contiguous_run_of_marks_is_one_multiple_ack_naming_its_highest_tag() -> None:
    assert plan_flush(0, ledger(M, M, M), forced=False) == AckFlush(3, (), 3, (1, 2, 3))


def test_one_mark_is_a_single_ack() -> None:
    assert plan_flush(0, ledger(M, OUT), forced=False) == AckFlush(None, (1,), 1, (1,))


def test_the_run_stops_at_the_first_outstanding_tag() -> None:
    # 3 is still running: 4 and 5 wait (not forced) ...
    assert plan_flush(0, ledger(M, M, OUT, M, M), forced=False) == AckFlush(2, (), 2, (1, 2))
    # ... or get single ACKs (forced): never a multiple ACK reaching over 3.
    assert plan_flush(0, ledger(M, M, OUT, M, M), forced=True) == AckFlush(2, (4, 5), 2, (1, 2, 4, 5))


def test_nothing_to_write_when_the_lowest_tag_is_outstanding() -> None:
    assert plan_flush(0, ledger(OUT, M), forced=False) == AckFlush(None, (), 0, ())


def test_settled_tags_extend_the_run_but_are_never_named() -> None:
    # 2 was NACKed on its own, 5 single-ACKed earlier: the frame names 4, the highest mark.
    assert plan_flush(0, ledger(M, S, M, M, S), forced=False) == AckFlush(4, (), 5, (1, 3, 4))
    # Only settled tags: the floor moves, no frame.
    assert plan_flush(0, ledger(S, S, OUT), forced=True) == AckFlush(None, (), 2, ())


def test_a_gap_in_the_numbering_counts_as_outstanding() -> None:
    tags = {1: M, 2: M, 4: M}  # 3 never arrived here
    assert plan_flush(0, tags, forced=False) == AckFlush(2, (), 2, (1, 2))
    assert plan_flush(0, tags, forced=True) == AckFlush(2, (4,), 2, (1, 2, 4))


def test_the_run_starts_above_the_floor() -> None:
    tags = ledger(M, M, floor=10)
    assert plan_flush(10, tags, forced=False) == AckFlush(12, (), 12, (11, 12))
    assert plan_flush(0, tags, forced=False) == AckFlush(None, (), 0, ())  # 1..10 unknown: outstanding


def test_the_ledger_is_not_changed() -> None:
    tags = ledger(M, OUT, M)
    before = dict(tags)
    plan_flush(0, tags, forced=True)
    assert tags == before
