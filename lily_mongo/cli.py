"""The ``lily-mongo`` command: run, demo, asyncapi, dlq, inbox.

Needs the ``cli`` extra (``pip install 'lily-mongo[cli]'``): typer for the
commands, rich for progress and tables, PyYAML for YAML output.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import sys
from typing import TYPE_CHECKING, Annotated, Any

try:
    import typer
    import yaml
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table
except ModuleNotFoundError as exc:  # pragma: no cover - exercised only without the extra
    print(f"lily-mongo needs the 'cli' extra: pip install 'lily-mongo[cli]' ({exc.name} is missing)", file=sys.stderr)
    raise SystemExit(2) from exc

import aio_pika
from pymongo import AsyncMongoClient

from . import inbox as inbox_records
from ._amqp import republish
from ._connect import redact_url
from ._logs import configure_logging
from .asyncapi import asyncapi_document
from .envelope import EVENT_ID_HEADER, RETRY_COUNT_HEADER
from .errors import LilyError, PublishError
from .inbox import InboxOptions
from .lifecycle import Consumer

if TYPE_CHECKING:
    from ._http import ProbeServer

__all__ = ["app", "main"]

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
app = typer.Typer(no_args_is_help=True, add_completion=False, help="Operate lily_mongo consumers.")
dlq_app = typer.Typer(no_args_is_help=True, help="Inspect and replay dead-lettered messages.")
inbox_app = typer.Typer(no_args_is_help=True, help="Inbox, lease and outbox statistics.")
app.add_typer(dlq_app, name="dlq")
app.add_typer(inbox_app, name="inbox")
console = Console()
err_console = Console(stderr=True)

AmqpOption = Annotated[str, typer.Option("--amqp-url", envvar="LILY_AMQP_URL", help="RabbitMQ URL.")]
MongoOption = Annotated[str, typer.Option("--mongo-uri", envvar="LILY_MONGO_URI", help="MongoDB URI.")]


def load_consumer(target: str) -> Consumer:
    """Import ``module:attribute`` and return the Consumer it names (a factory function is called)."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise typer.BadParameter(f"expected module:attribute, got {target!r}")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise typer.BadParameter(f"cannot import {module_name!r}: {exc}") from exc
    value = getattr(module, attribute, None)
    if value is None:
        raise typer.BadParameter(f"module {module_name!r} has no attribute {attribute!r}")
    if callable(value) and not isinstance(value, Consumer):
        value = value()
    if not isinstance(value, Consumer):
        raise typer.BadParameter(f"{target} is a {type(value).__name__}, not a lily_mongo.Consumer")
    return value


@app.command()
def run(
    target: Annotated[str, typer.Argument(help="module:consumer (a Consumer or a factory returning one)")],
    http_port: Annotated[
        int | None,
        typer.Option("--http-port", min=1, max=65535, help="Serve /healthz, /readyz and /metrics on this port."),
    ] = None,
    http_host: Annotated[str, typer.Option("--http-host", help="Address for --http-port.")] = "127.0.0.1",
    log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning or error.")] = "info",
    log_format: Annotated[str, typer.Option("--log-format", help="text or json.")] = "text",
) -> None:
    """Run a consumer until SIGTERM/SIGINT (graceful); a second signal forces. Prints the shutdown report.

    Exit status: 0 after a graceful shutdown that succeeded, 1 after a failed or forced one, 2 on a bad target.
    """
    try:
        configure_logging(log_level, log_format)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc

    async def main() -> int:
        consumer = load_consumer(target)
        probes = await _start_probes(http_host, http_port) if http_port is not None else None
        try:
            managed = await consumer.start()
            if probes is not None:
                probes.attach(managed)
            uninstall = managed.install_signal_handlers()
            err_console.print(f"[green]running[/] {consumer.name} ({len(managed.plan.queues)} queues); Ctrl-C to stop")
            try:
                report = await managed.wait()
            finally:
                uninstall()
        finally:
            if probes is not None:
                await probes.stop()
        console.print(report.render())
        # Non-zero when anything is unresolved or unobserved, and when the graceful
        # window did not suffice (a forced shutdown), so supervisors notice.
        return 0 if report.succeeded and not report.forced else 1

    try:
        code = asyncio.run(main())
    except LilyError as exc:
        err_console.print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from exc
    raise typer.Exit(code)


async def _start_probes(host: str, port: int) -> ProbeServer:
    """The /healthz, /readyz and /metrics server (the ``http`` extra), listening before the consumer starts."""
    try:
        from ._http import ProbeServer  # optional dependencies: imported only when asked for
    except ModuleNotFoundError as exc:
        err_console.print(f"[red]error:[/] --http-port needs the 'http' extra: pip install 'lily-mongo[http]' ({exc})")
        raise typer.Exit(2) from exc
    probes = ProbeServer(host, port)
    try:
        await probes.start()
    except OSError as exc:
        err_console.print(f"[red]error:[/] cannot listen on {host}:{port}: {exc.strerror}")
        raise typer.Exit(2) from exc
    return probes


@app.command()
def asyncapi(
    target: Annotated[str, typer.Argument(help="module:consumer")],
    fmt: Annotated[str, typer.Option("--format", help="json or yaml")] = "yaml",
) -> None:
    """Print the AsyncAPI 3.0 document of a consumer's handlers."""
    if fmt not in ("json", "yaml"):
        raise typer.BadParameter(f"--format must be json or yaml, got {fmt!r}")
    document = asyncapi_document(load_consumer(target).plan())
    if fmt == "json":
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    else:
        sys.stdout.write(yaml.safe_dump(document, sort_keys=False, allow_unicode=True))


@app.command()
def demo(
    orders: Annotated[int, typer.Option(min=10, max=1_000_000, help="Orders to publish.")] = 300,
    seed: Annotated[int | None, typer.Option(help="Workload seed (random by default).")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the workload to settle.")] = 180.0,
) -> None:
    """Run the example orders service on the embedded MongoDB (or LILY_MONGO_URI) and check its ledger."""
    from .demo import BrokerUnavailable, run_demo

    amqp_url = os.environ.get("LILY_AMQP_URL", DEFAULT_AMQP_URL)
    mongo_uri = os.environ.get("LILY_MONGO_URI")
    where = "LILY_MONGO_URI" if mongo_uri else "the embedded MongoDB-wire server"
    err_console.print(f"orders demo: {orders} orders, RabbitMQ {redact_url(amqp_url)}, MongoDB: {where}")
    with Progress(
        TextColumn("[bold]settling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err_console
    ) as bar:
        task = bar.add_task("settle", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        try:
            result = asyncio.run(
                run_demo(
                    orders=orders, amqp_url=amqp_url, mongo_uri=mongo_uri, seed=seed, timeout=timeout, progress=progress
                )
            )
        except BrokerUnavailable as exc:
            bar.stop()
            err_console.print(f"[red]error:[/] {exc}")
            raise typer.Exit(3) from exc
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
    table.add_row("orders.confirmed events relayed", str(result.confirmed_events))
    table.add_row("throughput", f"{result.throughput:.1f} messages/s over {result.elapsed:.1f} s")
    table.add_row("ledger check", "[green]PASS[/]" if result.ledger_ok else "[red]FAIL[/]")
    console.print(table)
    for problem in result.ledger_problems:
        console.print(f"[red]ledger:[/] {problem}")
    if result.shutdown is not None and not result.shutdown.succeeded:
        console.print(result.shutdown.render())
    raise typer.Exit(0 if result.ledger_ok else 1)


def _decode(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


@dlq_app.command("list")
def dlq_list(
    queue: Annotated[str, typer.Argument(help="The work queue (its DLQ is QUEUE.dlq).")],
    amqp_url: AmqpOption = DEFAULT_AMQP_URL,
    limit: Annotated[int, typer.Option(min=1, max=10_000)] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """List dead-lettered messages (bounded), leaving them in the DLQ."""

    async def main() -> list[dict[str, Any]]:
        connection = await aio_pika.connect(amqp_url)
        try:
            channel = await connection.channel()
            dlq = await channel.declare_queue(f"{queue}.dlq", passive=True)
            rows: list[dict[str, Any]] = []
            messages = []
            while len(rows) < limit:
                message = await dlq.get(no_ack=False, fail=False)
                if message is None:
                    break
                messages.append(message)
                headers = message.headers or {}
                rows.append(
                    {
                        "event_id": _decode(headers.get(EVENT_ID_HEADER, "")),
                        "code": _decode(headers.get("x-lily-failure-code", "broker-native")),
                        "reason": _decode(headers.get("x-lily-failure-reason", ""))[:200],
                        "failed_at": _decode(headers.get("x-lily-failed-at", "")),
                        "retry_count": headers.get(RETRY_COUNT_HEADER, 0),
                        "bytes": len(message.body),
                    }
                )
            # Listing must not consume: put every inspected message back.
            for message in messages:
                await message.nack(requeue=True)
            return rows
        finally:
            await connection.close()

    rows = asyncio.run(main())
    if as_json:
        for row in rows:
            sys.stdout.write(json.dumps(row) + "\n")
        return
    table = Table(title=f"{queue}.dlq ({len(rows)} shown)")
    for column in ("event_id", "code", "reason", "failed_at", "retry_count", "bytes"):
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(row[c]) for c in ("event_id", "code", "reason", "failed_at", "retry_count", "bytes")))
    console.print(table)


@dlq_app.command("replay")
def dlq_replay(
    queue: Annotated[str, typer.Argument(help="The work queue; messages move from QUEUE.dlq back to QUEUE.")],
    event_id: Annotated[list[str] | None, typer.Option("--event-id", help="Replay only these event ids.")] = None,
    replay_all: Annotated[bool, typer.Option("--all", help="Replay every message in the DLQ.")] = False,
    reset_retries: Annotated[bool, typer.Option("--reset-retries", help="Set x-retry-count to 0.")] = False,
    amqp_url: AmqpOption = DEFAULT_AMQP_URL,
    limit: Annotated[int, typer.Option(min=1, max=100_000)] = 10_000,
) -> None:
    """Move dead-lettered messages back to the work queue: publish + confirm, then ACK the DLQ copy."""
    if not replay_all and not event_id:
        raise typer.BadParameter("give --event-id (repeatable) or --all")
    wanted = set(event_id or ())

    async def main() -> tuple[int, int]:
        connection = await aio_pika.connect(amqp_url)
        moved = skipped = 0
        try:
            channel = await connection.channel()
            publish_channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            underlay = await publish_channel.get_underlay_channel()
            dlq = await channel.declare_queue(f"{queue}.dlq", passive=True)
            await channel.declare_queue(queue, passive=True)
            held = []
            for _ in range(limit):
                message = await dlq.get(no_ack=False, fail=False)
                if message is None:
                    break
                headers = dict(message.headers or {})
                if not replay_all and _decode(headers.get(EVENT_ID_HEADER, "")) not in wanted:
                    held.append(message)
                    skipped += 1
                    continue
                for key in (
                    "x-lily-failure-code",
                    "x-lily-failure-reason",
                    "x-lily-failed-queue",
                    "x-lily-failed-at",
                    "x-death",
                    "x-first-death-exchange",
                    "x-first-death-queue",
                    "x-first-death-reason",
                    "x-last-death-exchange",
                    "x-last-death-queue",
                    "x-last-death-reason",
                ):
                    headers.pop(key, None)
                if reset_retries:
                    headers[RETRY_COUNT_HEADER] = 0
                try:
                    await republish(underlay, message, routing_key=queue, headers=headers, timeout=10.0)
                except PublishError:
                    await message.nack(requeue=True)  # nothing lost: it stays in the DLQ
                    raise
                await message.ack()
                moved += 1
            for message in held:
                await message.nack(requeue=True)
        finally:
            await connection.close()
        return moved, skipped

    moved, skipped = asyncio.run(main())
    console.print(f"replayed {moved} message(s) from {queue}.dlq to {queue}; {skipped} left in the DLQ")


@inbox_app.command("stats")
def inbox_stats(
    database: Annotated[str, typer.Argument(help="The consumer's database.")],
    mongo_uri: MongoOption = "mongodb://127.0.0.1:27017/",
    records: Annotated[str, typer.Option(help="The inbox record collection (InboxOptions.records).")] = "lily_inbox",
    outbox: Annotated[str, typer.Option(help="The outbox collection (InboxOptions.outbox).")] = "lily_outbox",
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Completed records, live and expired leases, outbox pending/published/failed, per handler."""
    options = InboxOptions(records=records, outbox=outbox)

    async def main() -> dict[str, dict[str, int]]:
        client: AsyncMongoClient[Any] = AsyncMongoClient(mongo_uri, serverSelectionTimeoutMS=10_000)
        try:
            return await inbox_records.inbox_stats(client[database], options)
        finally:
            await client.close()

    stats = asyncio.run(main())
    if as_json:
        sys.stdout.write(json.dumps(stats, indent=2, sort_keys=True) + "\n")
        return
    table = Table(title=f"inbox statistics: {database}")
    columns = ("completed", "live_leases", "stale_leases", "outbox_pending", "outbox_published", "outbox_failed")
    table.add_column("handler")
    for column in columns:
        table.add_column(column, justify="right")
    for handler, values in sorted(stats.items()):
        table.add_row(handler, *(str(values[c]) for c in columns))
    console.print(table)


def main() -> None:
    """Console-script entry point."""
    app()
