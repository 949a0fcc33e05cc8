"""The commands' tables at 80, 120 and 160 columns: ids never split, borders never cropped."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from lily_mongo._cli.dlq import print_listing
from lily_mongo._cli.tables import print_inbox
from lily_mongo._inbox import STAT_COLUMNS
from lily_mongo.dlq import DeadLetter, DlqListing

WIDTHS = (80, 100, 120, 140, 160, 165, 200)
HANDLERS = (
    "payments.captured/v1/json/apply_captured_payment_to_the_ledger",
    "orders.created/v1/json/on_order_created",
    "refunds.requested/v2/json/refund",
)
EVENT_IDS = ("0f8fad5b-d9cb-469f-a165-70867728950e", "7c9e6679-7425-40de-944b-e07fc1f90ae7")
REASON = "the payment gateway answered 503 three times in a row and the order could not be confirmed"


def console(width: int) -> Console:
    return Console(width=width, record=True, color_system=None, force_terminal=False, legacy_windows=False)


def printed(out: Console) -> list[str]:
    return out.export_text().splitlines()


def assert_whole(lines: list[str], width: int, ids: tuple[str, ...]) -> None:
    assert all(len(line) <= width for line in lines), "\n".join(lines)
    for value in ids:
        assert any(value in line for line in lines), f"{value!r} split or cut at {width}:\n" + "\n".join(lines)
    for line in (line.rstrip() for line in lines):  # a table line starts and ends with a border, whole
        if line and line[0] in "┏┃┡│└┗┣":
            assert line[-1] in "┓┃┩│┘┛┤┫", f"cropped at {width}: {line!r}"


def stats() -> dict[str, dict[str, int]]:
    return {h: dict.fromkeys(STAT_COLUMNS, 12345) for h in HANDLERS}


@pytest.mark.parametrize("width", WIDTHS)
def test_inbox_stats_keep_every_handler_id_whole_at_any_width(width: int) -> None:
    out = console(width)
    print_inbox(out, "shop", stats(), STAT_COLUMNS)
    lines = printed(out)
    assert_whole(lines, width, HANDLERS)
    assert "12345" in "\n".join(lines)


def test_inbox_stats_are_a_table_where_it_fits_and_blocks_where_it_does_not() -> None:
    wide, narrow = console(160), console(80)
    print_inbox(wide, "shop", stats(), STAT_COLUMNS)
    print_inbox(narrow, "shop", stats(), STAT_COLUMNS)
    assert "┃ handler" in wide.export_text()
    text = narrow.export_text()
    assert "┃" not in text
    assert "  completed=12345, live_leases=12345, stale_leases=12345, outbox_pending=12345" in text
    assert not any(line.startswith("12345") for line in text.splitlines())  # no count apart from its name


def listing() -> DlqListing:
    messages = tuple(
        DeadLetter(
            event_id=event_id,
            origin="library",
            code="PAYMENT_DOWN",
            reason=REASON,
            broker_reason=None,
            untrusted_code=None,
            failed_at="2026-11-30T10:00:00+00:00",
            retry_count=5,
            bytes=18_432,
            malformed=None,
        )
        for event_id in EVENT_IDS
    )
    return DlqListing(queue="orders.created", dlq="orders.created.dlq", total=2, messages=messages)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("wide", [False, True])
def test_dlq_list_keeps_ids_and_headers_whole_and_its_borders_uncropped(
    width: int, wide: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = console(width)
    monkeypatch.setattr("lily_mongo._cli.dlq.console", out)
    print_listing(listing(), as_json=False, wide=wide)
    lines = printed(out)
    whole = (*EVENT_IDS, "PAYMENT_DOWN", "2026-11-30T10:00:00+00:00", "18432")
    if wide:  # the table at its own width: the terminal wraps its lines, none is cut
        assert all(any(value in line for line in lines) for value in whole)
        assert "┃ bytes" in "\n".join(lines) or "bytes ┃" in "\n".join(lines)
    else:
        assert_whole(lines, width, whole)
    # The reason is whole too, wrapped at its words (inside its cell, or in the message's block).
    assert all(re.search(rf"(^|[\s│]){re.escape(word)}([\s│]|$)", "\n".join(lines)) for word in REASON.split())
    if "┃" in "\n".join(lines):
        assert re.search(r"┃\s*bytes\s*┃", "\n".join(lines)), "\n".join(lines)  # the header whole, not 'b'
