"""``lily-mongo run``: one consumer process, or ``--workers N`` of them, ``--reload`` (docs/deployment.md)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Annotated

import typer

from .._redact import redact_url
from .._signals import ShutdownSignals, graceful_notice
from .._text import bind_reason
from .errors import Settings, fail, reported, say
from .exit_codes import ExitCode
from .logs import configure_logging
from .options import console
from .target import consumer_urls, load_consumer
from .workers import WorkerLink

if TYPE_CHECKING:
    from .._lifecycle import Consumer, ManagedConsumer
    from .._supervision import ShutdownReport
    from .probes import ProbeServer


def run(
    ctx: typer.Context,
    target: Annotated[str, typer.Argument(help="module:consumer (a Consumer or a factory returning one)")],
    http_port: Annotated[
        int | None,
        typer.Option(
            "--http-port", min=0, max=65535, help="Serve /healthz, /readyz and /metrics on this port (0: any free one)."
        ),
    ] = None,
    http_host: Annotated[str, typer.Option("--http-host", help="Address for --http-port.")] = "127.0.0.1",
    log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning or error.")] = "info",
    log_format: Annotated[str, typer.Option("--log-format", help="text or json.")] = "text",
    workers: Annotated[
        int,
        typer.Option(
            "--workers", min=1, max=64, help="Run this many worker processes of the target (competing consumers)."
        ),
    ] = 1,
    reload: Annotated[
        bool, typer.Option("--reload", help="Restart gracefully when a .py file under the current directory changes.")
    ] = False,
    worker_index: Annotated[int | None, typer.Option("--worker-index", hidden=True)] = None,
    worker_fd: Annotated[int | None, typer.Option("--worker-fd", hidden=True)] = None,
) -> None:
    """Run a consumer until SIGTERM/SIGINT (graceful); a second signal at least 1 s later forces. Prints the
    shutdown report.

    Exit status: 0 after a graceful shutdown that succeeded, 1 after a failed or forced one, 2 on a bad
    target or plan, 3 when RabbitMQ or MongoDB cannot be reached (or MongoDB has no transactions for the
    inbox), 130 when a signal stopped it while it started. With --workers N: 0 only when every worker shut
    down gracefully.
    """
    settings = ctx.find_object(Settings)
    debug = settings is not None and settings.debug
    try:
        configure_logging(log_level, log_format, debug=debug, worker=worker_index)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    as_json = log_format == "json"
    if workers > 1 or reload:
        from .workers import WorkerOptions, supervise

        options = WorkerOptions(
            target=target,
            workers=workers,
            reload=reload,
            http=(http_host, http_port) if http_port is not None else None,
            log_level=log_level,
            log_format=log_format,
            debug=debug,
        )
        with reported(ctx):
            if not reload:  # one clear error for a bad target, before any worker starts
                load_consumer(target)
            code = asyncio.run(supervise(options))
        raise typer.Exit(code)

    consumer: Consumer | None = None
    with reported(ctx):
        consumer = load_consumer(target)
    hints: dict[str | None, str] = {None: "is it running? Check the consumer's amqp_url"}
    with reported(ctx, consumer_urls(consumer), hints=hints):
        link = WorkerLink.open(worker_fd) if worker_fd is not None else None
        code = asyncio.run(_run_consumer(consumer, http_host, http_port, as_json, link, worker_index))
    raise typer.Exit(code)


async def _run_consumer(
    consumer: Consumer,
    http_host: str,
    http_port: int | None,
    as_json: bool,
    link: WorkerLink | None,
    worker_index: int | None,
) -> int:
    """Start, run until a signal, shut down, print the report; the exit status.

    The signal policy is installed first, so a signal during the start (a slow MongoDB or
    broker) stops it cleanly: the start is cancelled, what started is torn down.
    """
    settings = consumer.settings
    managed: ManagedConsumer | None = None
    starting: asyncio.Future[ManagedConsumer] | None = None

    def graceful() -> None:
        if managed is not None:
            managed.request_shutdown()
        elif starting is not None:
            starting.cancel()

    def force() -> None:
        if managed is not None:
            managed.request_force()

    from .._mongo import describe_client  # PyMongo: imported when a consumer runs, not for --help

    signals = ShutdownSignals(graceful, force, notice="stopping: the start is interrupted")
    uninstall = signals.install()
    watch: asyncio.Task[None] | None = None
    try:
        mongo = settings.mongo_client
        where = f", MongoDB {describe_client(mongo)}" if mongo is not None else ""
        queues = len(consumer.plan().queues)
        say.info(
            "starting %s (%d queue%s): RabbitMQ %s%s",
            consumer.name,
            queues,
            "" if queues == 1 else "s",
            redact_url(settings.amqp_url),
            where,
        )
        probes = await start_probes(http_host, http_port) if http_port is not None else None
        try:
            if probes is not None and link is not None:
                link.send({"event": "http", "port": probes.port})
            if link is not None:
                watch = asyncio.ensure_future(link.wait_closed(signals))
            starting = asyncio.ensure_future(consumer.start())
            try:
                managed = await starting
            except asyncio.CancelledError:
                if starting.cancelled() and signals.received:
                    say.warning("stopped while starting: nothing was left running")
                    return ExitCode.INTERRUPTED
                raise
            signals.notice = graceful_notice(settings.graceful_timeout)
            if probes is not None:
                probes.attach(managed)
            if signals.received:  # a signal as the start completed
                managed.request_shutdown()
            if link is not None:
                link.send({"event": "running"})
            say.info("running %s; Ctrl-C or SIGTERM stops it gracefully", consumer.name)
            report = await managed.wait()
        finally:
            if probes is not None:
                await probes.stop()
    finally:
        uninstall()
        if watch is not None:
            watch.cancel()
    print_report(report, as_json, worker_index)
    # Non-zero when anything is unresolved or unobserved, and when the graceful
    # window did not suffice (a forced shutdown), so supervisors notice.
    return ExitCode.OK if report.graceful else ExitCode.FAILED


def print_report(report: ShutdownReport, as_json: bool, worker_index: int | None) -> None:
    """The shutdown report: its text on stdout, or one JSON object on stderr with ``--log-format json``."""
    if as_json:
        fields = {
            "succeeded": report.succeeded,
            "forced": report.forced,
            "graceful": report.graceful,
            "unresolved": report.unresolved,
            "settled": dict(report.settled),
            "totals": dict(report.totals),
            "elapsed": round(report.elapsed, 3),
            "actions": [
                {"name": a.name, "ok": a.ok, "observed": a.observed, "error": a.error, "duration": round(a.duration, 3)}
                for a in report.actions
            ],
        }
        first = report.render().splitlines()[0]
        say.log(logging.INFO if report.graceful else logging.WARNING, "%s", first, extra={"report": fields})
        return
    text = report.render()
    if worker_index is not None:
        text = "\n".join(f"[worker {worker_index}] {line}" for line in text.splitlines())
    console.print(text, markup=False, highlight=False, soft_wrap=True)


async def start_probes(host: str, port: int) -> ProbeServer:
    """The /healthz, /readyz and /metrics server (the ``http`` extra), listening before the consumer starts."""
    try:
        from .probes import ProbeServer  # optional dependencies: imported only when asked for
    except ModuleNotFoundError as exc:
        fail(ExitCode.USAGE, f"--http-port needs the 'http' extra: pip install 'lily-mongo[http]' ({exc})")
    probes = ProbeServer(host, port)
    try:
        await probes.start()
    except OSError as exc:
        await probes.stop()
        fail(ExitCode.USAGE, f"cannot listen on {host}:{port}: {bind_reason(exc, host)}")
    return probes
