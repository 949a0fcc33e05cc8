"""``lily-mongo dlq list`` and ``dlq replay`` (docs/operations.md, section 5)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

from .errors import fail, reported, tell
from .exit_codes import ExitCode
from .options import AMQP_HINT, DEFAULT_AMQP_URL, AmqpOption, console
from .tables import fits, listing_table, print_wide

if TYPE_CHECKING:
    from ..dlq import DlqListing


DLQ_COLUMNS: tuple[tuple[str, Callable[[Any], object]], ...] = (
    ("event id", lambda m: m.event_id or "-"),
    ("origin", lambda m: m.origin),
    ("code", lambda m: m.display_code()),
    ("reason", lambda m: m.reason or "-"),
    ("failed at", lambda m: m.failed_at or "-"),
    ("retries", lambda m: "-" if m.retry_count is None else m.retry_count),
    ("bytes", lambda m: m.bytes),
)


def print_listing(listing: DlqListing, as_json: bool, wide: bool = False) -> None:
    summary = (
        f"{listing.dlq}: {listing.total} message(s), {len(listing.messages)} listed "
        "(each put back at the end of the queue)"
    )
    if as_json:
        for message in listing.messages:
            sys.stdout.write(json.dumps(message.as_json()) + "\n")
        tell(summary)
        return
    # Whole values: only the reason wraps (at its words); ids, codes, times and sizes never do.
    rows = [[str(cell(message)) for _, cell in DLQ_COLUMNS] for message in listing.messages]
    table = listing_table(summary, [name for name, _ in DLQ_COLUMNS], rows, prose="reason")
    if wide:
        print_wide(console, table)
    elif fits(console, table):
        console.print(table)
    else:
        # A terminal too narrow for the whole table: each message is a block whose lines wrap at
        # the terminal's width (--wide forces the table, --json is whole).
        console.print(summary, markup=False, highlight=False)
        for message in listing.messages:
            retries = "-" if message.retry_count is None else message.retry_count
            console.print(
                f"\n{message.event_id or '-'}  {message.origin}  {message.display_code()}\n"
                f"  failed at {message.failed_at or '-'}, retries {retries}, {message.bytes} bytes\n"
                f"  reason: {message.reason or '-'}",
                markup=False,
                highlight=False,
            )
    if any(m.malformed for m in listing.messages):
        tell("some messages' metadata was not valid UTF-8 and is shown as read leniently (--json: 'malformed')")


def dlq_list(
    ctx: typer.Context,
    queue: Annotated[str, typer.Argument(help="The work queue (its DLQ is QUEUE.dlq).")],
    amqp_url: AmqpOption = DEFAULT_AMQP_URL,
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="List at most this many messages.")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per message and line.")] = False,
    wide: Annotated[
        bool,
        typer.Option(
            "--wide", help="A table whatever the terminal's width (else one block per message where it does not fit)."
        ),
    ] = False,
) -> None:
    """List dead-lettered messages, oldest first, leaving them in the DLQ (moved to its end).

    The origin column tells library copies (the consumer wrote the failure code) from broker
    dead letters (RabbitMQ moved the original, e.g. an oversize body); a failure code the
    evidence does not back is shown as untrusted.
    """
    with reported(ctx, amqp_url, unreachable=AMQP_HINT):
        from ..dlq import list_dead_letters  # the AMQP client: imported when the command runs

        listing = asyncio.run(list_dead_letters(amqp_url, queue, limit=limit))
    print_listing(listing, as_json, wide)


def dlq_replay(
    ctx: typer.Context,
    queue: Annotated[str, typer.Argument(help="The work queue; messages move from QUEUE.dlq back to QUEUE.")],
    event_id: Annotated[
        list[str] | None, typer.Option("--event-id", help="Replay the message with this event id (repeatable).")
    ] = None,
    replay_all: Annotated[bool, typer.Option("--all", help="Replay every message in the DLQ.")] = False,
    reset_retries: Annotated[bool, typer.Option("--reset-retries", help="Set x-retry-count to 0.")] = False,
    amqp_url: AmqpOption = DEFAULT_AMQP_URL,
    limit: Annotated[int, typer.Option(min=1, max=100_000, help="Inspect at most this many messages.")] = 10_000,
) -> None:
    """Move dead-lettered messages back to the work queue: publish + confirm, then ACK the DLQ copy.

    Give --event-id (repeatable) or --all, not both. An event id found on no message ends with
    status 1 (the others are replayed).
    """
    from ..dlq import replay_dead_letters  # the AMQP client: imported when the command runs

    with reported(ctx, amqp_url, unreachable=AMQP_HINT):
        if replay_all and event_id:
            fail(ExitCode.USAGE, "give --event-id or --all, not both (--all would replay every message)")
        if not replay_all and not event_id:
            fail(ExitCode.USAGE, "give --event-id (repeatable) or --all")
        result = asyncio.run(
            replay_dead_letters(
                amqp_url,
                queue,
                event_ids=event_id or (),
                replay_all=replay_all,
                reset_retries=reset_retries,
                limit=limit,
            )
        )
        console.print(
            f"replayed {result.moved} message(s) from {queue}.dlq to {queue}; {result.kept} left in the DLQ",
            markup=False,
            highlight=False,
        )
        if result.missing:
            fail(
                ExitCode.FAILED,
                f"no message in {queue}.dlq carries event id {', '.join(result.missing)} "
                f"({result.scanned} message(s) inspected)",
            )
