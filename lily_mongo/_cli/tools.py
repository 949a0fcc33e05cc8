"""The development and inspection commands: ``asyncapi``, ``demo``, ``inbox stats``, ``embedded``."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
import yaml
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .._redact import redact_url
from .._signals import ShutdownSignals
from .._text import bind_reason
from .errors import fail, reported, say, tell
from .exit_codes import ExitCode
from .options import DEFAULT_AMQP_URL, DEFAULT_MONGO_URI, MONGO_HINT, MongoOption, console, err_console
from .tables import print_inbox
from .target import load_consumer, load_outbox

if TYPE_CHECKING:
    from .demo import DemoResult


def asyncapi(
    ctx: typer.Context,
    target: Annotated[str, typer.Argument(help="module:consumer")],
    fmt: Annotated[str, typer.Option("--format", help="json or yaml")] = "yaml",
    outboxes: Annotated[
        list[str] | None,
        typer.Option("--outbox", help="An Outbox (module:attribute) whose sends() declarations to add; repeatable."),
    ] = None,
) -> None:
    """Print the AsyncAPI 3.0 document of a consumer's handlers and declared outgoing messages (and those
    of each --outbox)."""
    with reported(ctx):
        if fmt not in ("json", "yaml"):
            fail(ExitCode.USAGE, f"--format must be json or yaml, got {fmt!r}")
        from ..asyncapi import asyncapi_document  # the package: imported when the command runs

        consumer = load_consumer(target)
        outgoing = [*consumer.outgoing]
        for where in outboxes or ():
            outgoing += load_outbox(where).outgoing
        document = asyncapi_document(consumer.plan(), outgoing=outgoing)
    if fmt == "json":
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    else:
        sys.stdout.write(yaml.safe_dump(document, sort_keys=False, allow_unicode=True))


def demo(
    ctx: typer.Context,
    orders: Annotated[int, typer.Option(min=10, max=1_000_000, help="Orders to publish.")] = 300,
    seed: Annotated[int | None, typer.Option(help="Workload seed (random by default).")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the workload to settle.")] = 180.0,
) -> None:
    """Run the example orders service on the embedded MongoDB (or LILY_MONGO_URI) and check its ledger."""
    from .demo import run_demo

    amqp_url = os.environ.get("LILY_AMQP_URL", DEFAULT_AMQP_URL)
    mongo_uri = os.environ.get("LILY_MONGO_URI")
    where = redact_url(mongo_uri) if mongo_uri else "the embedded MongoDB-wire server"
    tell(f"orders demo: {orders} orders, RabbitMQ {redact_url(amqp_url)}, MongoDB: {where}")
    with (
        reported(ctx, amqp_url, mongo_uri),
        Progress(
            TextColumn("[bold]settling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err_console
        ) as bar,
    ):
        task = bar.add_task("settle", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        result = asyncio.run(
            run_demo(
                orders=orders, amqp_url=amqp_url, mongo_uri=mongo_uri, seed=seed, timeout=timeout, progress=progress
            )
        )
    table = Table(title="orders demo summary", show_header=True)
    table.add_column("measure")
    table.add_column("value", justify="right")
    outcomes = result.outcomes
    table.add_row(
        "orders published (messages incl. duplicates and poison)", f"{result.orders} ({result.published_messages})"
    )
    table.add_row("processed (acked)", str(outcomes.get("acked", 0)))
    table.add_row("duplicates absorbed", str(outcomes.get("duplicate", 0)))
    table.add_row("retried (retry bucket)", str(outcomes.get("retried", 0)))
    table.add_row("deferred (lease held / ambiguous)", str(outcomes.get("deferred", 0)))
    for code, count in sorted(result.dead_lettered_by_code.items()):
        table.add_row(f"dead-lettered: {code}", str(count))
    table.add_row("transient replays", str(result.transient_replays))
    table.add_row("commit reconciliations", str(result.reconciliations))
    table.add_row("orders applied / expected", f"{result.applied_orders} / {result.expected_orders}")
    table.add_row("orders.confirmed events published", str(result.confirmed_events))
    table.add_row("throughput", f"{result.throughput:.1f} messages/s over {result.elapsed:.1f} s")
    table.add_row("ledger check", "[green]PASS[/]" if result.ledger_ok else "[red]FAIL[/]")
    console.print(table)
    console.print("legend:", markup=False, highlight=False)
    console.print(demo_legend(result), markup=False, highlight=False)
    for problem in result.ledger_problems:
        console.print(f"[red]ledger:[/] {problem}")
    if result.shutdown is not None and not result.shutdown.succeeded:
        console.print(result.shutdown.render())
    raise typer.Exit(ExitCode.OK if result.ledger_ok else ExitCode.FAILED)


def demo_legend(result: DemoResult) -> Table:
    """What the demo's counters mean: a term and its meaning a row, wrapped to the console's width."""
    duplicates = result.published_messages - result.orders - result.poison
    replays = f"attempts re-run after a transient error ({result.injected_failures} injected) or a failed commit"
    if result.emulator:
        replays += (
            "; the embedded server conflicts per document, as MongoDB does: a commit fails only when another "
            "write reached one of its documents first (docs/emulator.md)"
        )
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column()
    for term, meaning in (
        (
            "published:",
            f"{result.orders} orders once each, {duplicates} duplicate copies (same event id) and "
            f"{result.poison} poison messages: {result.published_messages} messages",
        ),
        (
            "settled:",
            "the progress bar: orders applied + messages dead-lettered; duplicates and retry copies are not "
            "counted there",
        ),
        ("retried:", "a flaky payment's first attempt went to a retry bucket; its copy came back and was applied"),
        ("deferred:", "requeued without spending a retry (a concurrent copy held the lease, a replay budget ran out)"),
        ("transient replays:", replays),
        ("published events:", "orders.confirmed events the outbox published (dispatched after commit or relayed)"),
    ):
        grid.add_row(term, meaning)
    return grid


def inbox_stats(
    ctx: typer.Context,
    database: Annotated[str, typer.Argument(help="The consumer's database.")],
    mongo_uri: MongoOption = DEFAULT_MONGO_URI,
    records: Annotated[str, typer.Option(help="The inbox record collection (InboxOptions.records).")] = "lily_inbox",
    outbox: Annotated[str, typer.Option(help="The outbox collection (OutboxOptions' collection).")] = "lily_outbox",
    timeout: Annotated[
        float, typer.Option(min=0.1, max=600, help="Seconds to wait for a MongoDB server to answer.")
    ] = 10.0,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Completed records, live and expired leases, outbox pending/published/failed, per handler."""
    from .._inbox import STAT_COLUMNS, InboxOptions  # the package: imported when the command runs
    from .._inbox import inbox_stats as read_inbox_stats
    from .._mongo import mongo_errors, open_mongo
    from .._mongo.errors import MONGODB
    from .._outbox import OutboxOptions

    options = InboxOptions(records=records)
    outbox_options = OutboxOptions(collection=outbox)

    async def main() -> dict[str, dict[str, int]]:
        client = await open_mongo(mongo_uri, timeout=timeout)
        try:
            with mongo_errors("reading the inbox statistics", uri=mongo_uri):
                present = set(await client[database].list_collection_names())
                if records not in present and outbox not in present:
                    fail(
                        ExitCode.USAGE,
                        f"database {database!r} has neither a {records!r} nor a {outbox!r} collection: is it the "
                        "consumer's database? (a consumer with a mongo_client creates them when it starts)",
                    )
                return await read_inbox_stats(client[database], options, outbox=outbox_options.collection)
        finally:
            await client.close()

    with reported(ctx, mongo_uri, hints={MONGODB: MONGO_HINT}):
        stats = asyncio.run(main())
    if as_json:
        sys.stdout.write(json.dumps(stats, indent=2, sort_keys=True) + "\n")
        return
    if not stats:
        console.print(f"inbox statistics: {database}: no records and no outbox records yet")
        return
    print_inbox(console, database, stats, STAT_COLUMNS)


def embedded(
    ctx: typer.Context,
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on (0: any free one).")] = 27017,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    data: Annotated[
        Path | None,
        typer.Option(
            help="Keep the data in this directory between runs (mongoeco's SQLite engine: one transaction at a time)."
        ),
    ] = None,
) -> None:
    """Run the embedded MongoDB-wire server (mongoeco) for developing your own service, until SIGTERM or Ctrl-C.

    Prints the URI to use on stdout. In memory by default: its data is gone when it stops.
    It emulates MongoDB (sessions, transactions, TTL indexes); docs/emulator.md lists where it differs.
    """
    from ..embedded import DATA_FILE, available, serve

    with reported(ctx):
        if not available():
            fail(ExitCode.USAGE, "the embedded server needs the 'embedded' extra: pip install 'lily-mongo[embedded]'")
        if data is not None:
            try:
                data.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                fail(ExitCode.USAGE, f"--data {data}: cannot use it as a directory ({exc.strerror or exc})")

        def announce(uri: str) -> None:
            bound = uri.split("://", 1)[1].split("/", 1)[0]  # host:port as it listens
            plain = f"mongodb://{bound}/"
            sys.stdout.write(plain + "\n")
            sys.stdout.flush()
            if data is None:
                kept = "in memory: its data is gone when it stops (--data DIR keeps it)"
            else:
                kept = (
                    f"data kept in {data / DATA_FILE} (mongoeco's SQLite engine runs one transaction at a time: "
                    "a second concurrent one fails, so give your consumer's queues concurrency=1)"
                )
            say.info(
                "embedded MongoDB (mongoeco, an emulator: see docs/emulator.md) listening at %s, %s; "
                "point your service's AsyncMongoClient (or LILY_MONGO_URI) at it. Ctrl-C or SIGTERM stops it",
                plain,
                kept,
            )

        async def main() -> None:
            stop = asyncio.Event()
            uninstall = ShutdownSignals(stop.set, stop.set, notice="stopping the embedded MongoDB").install()
            try:
                await serve(host, port, stop=stop, data=data, announce=announce)
            except OSError as exc:
                fail(ExitCode.USAGE, f"cannot listen on {host}:{port}: {bind_reason(exc, host)}")
            finally:
                uninstall()

        asyncio.run(main())
