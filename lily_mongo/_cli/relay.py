"""``lily-mongo relay``: the backstop relay as a process of its own (docs/outbox.md)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated

import typer

from .errors import Settings, reported, say
from .exit_codes import ExitCode
from .logs import configure_logging
from .options import DEFAULT_AMQP_URL, DEFAULT_MONGO_URI, AmqpOption, MongoOption
from .run import print_report, start_probes

if TYPE_CHECKING:
    pass


def relay(
    ctx: typer.Context,
    database: Annotated[
        str, typer.Option("--database", envvar="LILY_MONGO_DATABASE", help="The database holding the outbox.")
    ],
    mongo_uri: MongoOption = DEFAULT_MONGO_URI,
    amqp_url: AmqpOption = DEFAULT_AMQP_URL,
    collection: Annotated[str, typer.Option(help="The outbox collection (OutboxOptions' collection).")] = "lily_outbox",
    batch_size: Annotated[int, typer.Option(min=1, max=1000, help="Records claimed per batch.")] = 100,
    poll_interval: Annotated[
        float, typer.Option(min=0.01, max=3600, help="Seconds between polls while nothing is due.")
    ] = 1.0,
    claim_seconds: Annotated[
        float, typer.Option(min=0.1, max=86400, help="How long a claimed batch is this relay's.")
    ] = 30.0,
    max_attempts: Annotated[
        int, typer.Option(min=1, max=1000, help="Failed publishes before a record is parked.")
    ] = 10,
    name: Annotated[str, typer.Option(help="The relay's name in its claims (claim_owner).")] = "lily-relay",
    http_port: Annotated[
        int | None,
        typer.Option("--http-port", min=1, max=65535, help="Serve /healthz, /readyz and /metrics on this port."),
    ] = None,
    http_host: Annotated[str, typer.Option("--http-host", help="Address for --http-port.")] = "127.0.0.1",
    log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning or error.")] = "info",
    log_format: Annotated[str, typer.Option("--log-format", help="text or json.")] = "text",
) -> None:
    """Run the outbox's backstop relay alone until SIGTERM/SIGINT (graceful); a second signal forces.

    It publishes the outbox records no consumer's dispatcher published (written by Outbox.transaction
    without amqp_url, or whose writer died), in batches, with confirms. Exit status: 0 after a graceful
    stop that succeeded, 1 after a failed or forced one, 2 on a bad option, 3 when RabbitMQ or MongoDB
    cannot be reached.
    """
    settings = ctx.find_object(Settings)
    try:
        configure_logging(log_level, log_format, debug=settings is not None and settings.debug)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc

    from .._mongo import open_mongo  # the package: imported when the command runs, not for --help
    from .._outbox import OutboxOptions, Relay

    async def main() -> int:
        options = OutboxOptions(
            collection=collection,
            batch_size=batch_size,
            poll_interval=poll_interval,
            claim_seconds=claim_seconds,
            mark_interval=min(OutboxOptions().mark_interval, claim_seconds / 2),
            max_attempts=max_attempts,
        )
        client = await open_mongo(mongo_uri)
        try:
            service = Relay(client, database, amqp_url=amqp_url, options=options, name=name, owns_mongo_client=True)
        except BaseException:
            await client.close()
            raise
        probes = await start_probes(http_host, http_port) if http_port is not None else None
        try:
            await service.start()  # a failed start closes the client (the relay owns it)
            if probes is not None:
                probes.attach(service)
            uninstall = service.install_signal_handlers()
            say.info("relaying %s.%s as %s; Ctrl-C or SIGTERM stops it gracefully", database, collection, name)
            try:
                report = await service.wait()
            finally:
                uninstall()
        finally:
            if probes is not None:
                await probes.stop()
        print_report(report, log_format == "json", None)
        return ExitCode.OK if report.graceful else ExitCode.FAILED

    with reported(ctx, amqp_url, mongo_uri, unreachable="is it running? Check --amqp-url and --mongo-uri"):
        code = asyncio.run(main())
    raise typer.Exit(code)
