"""The ``lily-mongo`` command: run, relay, demo, asyncapi, dlq, inbox, embedded.

A thin shell: each command parses its options, calls the package (``lifecycle``,
``relay``, ``demo``, ``asyncapi``, ``dlq``, ``inbox.inbox_stats``, ``embedded``; ``_workers`` for
``run --workers`` and ``--reload``) and prints the result. Errors end the command
with one line on stderr saying what failed and what to do, and a documented exit
status (usage errors too: one ``error:`` line, status 2); ``--debug`` adds the
traceback (never local variables, and with passwords masked). The command's own
lines go through the ``lily_mongo.cli`` logger (``_logs``), so ``run --log-format
json`` writes nothing but JSON objects on stderr.

Needs the ``cli`` extra (``pip install 'lily-mongo[cli]'``): typer for the
commands, rich for progress and tables, PyYAML for YAML output.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import importlib
import importlib.metadata
import inspect
import json
import logging
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

try:
    import typer
    import yaml
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table
except ModuleNotFoundError as exc:  # pragma: no cover - exercised only without the extra
    print(f"lily-mongo needs the 'cli' extra: pip install 'lily-mongo[cli]' ({exc.name} is missing)", file=sys.stderr)
    raise SystemExit(2) from exc

from .._errors import ConfigError, LilyError, PublishError, TransportError
from .._inbox import STAT_COLUMNS, InboxOptions
from .._inbox import inbox_stats as read_inbox_stats
from .._lifecycle import Consumer
from .._mongo import describe_client, mongo_errors, open_mongo
from .._mongo.errors import MONGODB
from .._outbox import OutboxOptions, Relay
from .._plan.plan import routes_of
from .._redact import redact_url, scrub
from .._signals import ShutdownSignals, graceful_notice
from .._text import bind_reason, describe_value
from ..asyncapi import asyncapi_document
from ..dlq import DlqListing, list_dead_letters, replay_dead_letters
from .logs import COMMAND_LOGGER, configure_logging

if TYPE_CHECKING:
    from .._lifecycle import ManagedConsumer
    from .._supervision import ShutdownReport
    from .demo import DemoResult
    from .probes import ProbeServer

__all__ = ["ExitCode", "app", "main"]


class ExitCode(enum.IntEnum):
    """The command's exit status (also in ``--help`` and docs/operations.md)."""

    OK = 0
    FAILED = 1  # the command ran and failed (a failed or forced shutdown, a ledger mismatch, nothing to replay)
    USAGE = 2  # bad usage: an option, a target that is not a Consumer, a plan error, a queue that does not exist
    UNAVAILABLE = 3  # RabbitMQ or MongoDB unreachable, refusing the login or virtual host, or without transactions
    INTERRUPTED = 130  # run: SIGINT or SIGTERM before the consumer had started (it stopped cleanly)


EXIT_CODES = (
    "Exit status: 0 success; 1 the command failed (run: a forced or failed shutdown); 2 bad usage (an option, "
    "a target that is not a Consumer, an invalid plan, a queue that does not exist); 3 RabbitMQ or MongoDB "
    "unreachable or refusing the connection; 130 run was stopped by a signal while starting. Errors are one "
    "line on stderr; --debug adds the traceback."
)
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
DEFAULT_MONGO_URI = "mongodb://127.0.0.1:27017/"

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="Operate lily_mongo consumers.",
    epilog=EXIT_CODES,
    # Tracebacks with local variables would print URLs with their passwords; errors are
    # reported by the commands themselves (one line, or a plain traceback with --debug).
    pretty_exceptions_enable=False,
    pretty_exceptions_show_locals=False,
)
dlq_app = typer.Typer(no_args_is_help=True, help="Inspect and replay dead-lettered messages.", epilog=EXIT_CODES)
inbox_app = typer.Typer(no_args_is_help=True, help="Inbox, lease and outbox statistics.", epilog=EXIT_CODES)
app.add_typer(dlq_app, name="dlq")
app.add_typer(inbox_app, name="inbox")
console = Console()
err_console = Console(stderr=True)
say = logging.getLogger(COMMAND_LOGGER)  # the command's own lines: plain as text, one object each as JSON

_AMQP_HINT = "is it running? Check --amqp-url (or LILY_AMQP_URL)"
_MONGO_HINT = "is it running? Check --mongo-uri (or LILY_MONGO_URI)"
AmqpOption = Annotated[str, typer.Option("--amqp-url", envvar="LILY_AMQP_URL", help="RabbitMQ URL.")]
MongoOption = Annotated[str, typer.Option("--mongo-uri", envvar="LILY_MONGO_URI", help="MongoDB URI.")]


@dataclass(frozen=True)
class _Settings:
    debug: bool


def _version() -> str:
    return importlib.metadata.version("lily-mongo")


def _print_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"lily-mongo {_version()}\n")
        raise typer.Exit()


@app.callback()
def _options(
    ctx: typer.Context,
    debug: Annotated[
        bool,
        typer.Option("--debug", envvar="LILY_MONGO_DEBUG", help="Show the traceback of an error (passwords masked)."),
    ] = False,
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="Print the version and exit."),
    ] = False,
) -> None:
    ctx.obj = _Settings(debug=debug)
    # The package's warnings (with --debug its INFO lines too); `run` sets its own level and format.
    configure_logging("info" if debug else "warning", debug=debug)


# -- errors ------------------------------------------------------------------------------------------


class CommandError(Exception):
    """An error a command reports as one line, with its exit status."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _classify(exc: BaseException, hints: dict[str | None, str] | None = None) -> tuple[ExitCode, str]:
    """The exit status and the one line for an exception that ended a command.

    Only lily errors are classified: the package maps its dependencies' errors at their
    boundary (``_amqp.errors``, ``_mongo``); anything else is unexpected. ``hints`` is the
    advice appended when nothing answered, by the party (``TransportError.service``; None
    for RabbitMQ, whose errors do not name it there).
    """
    if isinstance(exc, CommandError):
        return exc.code, str(exc)
    if isinstance(exc, PublishError):
        return ExitCode.FAILED, f"{exc}; nothing was lost: the message stays where it was"
    if isinstance(exc, TransportError):
        hint = (hints or {}).get(exc.service) if exc.unreachable else None
        return ExitCode.UNAVAILABLE, f"{exc}; {hint}" if hint else str(exc)
    if isinstance(exc, ConfigError):  # PlanError included
        return ExitCode.USAGE, str(exc)
    if isinstance(exc, LilyError):
        return ExitCode.FAILED, str(exc)
    return ExitCode.FAILED, f"unexpected {type(exc).__name__}: {exc} (run with --debug for the traceback)"


@contextlib.contextmanager
def _reported(
    ctx: typer.Context, *urls: str | None, unreachable: str = "", hints: dict[str | None, str] | None = None
) -> Iterator[None]:
    """End the command on any error with one line (and the traceback with --debug), passwords masked.

    ``unreachable`` is the advice appended when nothing answered at a RabbitMQ URL; ``hints``
    gives it by party (``{"MongoDB": ...}``, see :func:`_classify`).
    """
    try:
        yield
    except (typer.Exit, typer.Abort, typer.TyperException):
        raise
    except KeyboardInterrupt:
        _err("interrupted", level=logging.WARNING)
        raise typer.Exit(ExitCode.INTERRUPTED) from None
    except Exception as exc:
        code, message = _classify(exc, {None: unreachable, **(hints or {})} if unreachable else hints)
        settings = ctx.find_object(_Settings)
        trace = None
        if settings is not None and settings.debug:
            trace = _scrubbed("".join(traceback.format_exception(exc)).rstrip(), urls)
        _err(message, urls, level=logging.ERROR, traceback=trace)
        raise typer.Exit(code) from None


def _scrubbed(text: str, urls: tuple[str | None, ...]) -> str:
    for url in urls:
        if url:
            text = scrub(text, url)
    return text


def _err(
    text: str, urls: tuple[str | None, ...] = (), *, level: int = logging.INFO, traceback: str | None = None
) -> None:
    """One of the command's own lines on stderr (an ``error:`` line at ERROR), passwords masked."""
    say.log(level, "%s", _scrubbed(text, urls), extra={"traceback": traceback} if traceback else None)


def _fail(code: ExitCode, message: str) -> NoReturn:
    raise CommandError(code, message)


# -- targets -----------------------------------------------------------------------------------------


def load_consumer(target: str) -> Consumer:
    """Import ``module:attribute``: a Consumer, or a plain function taking no arguments that returns one.

    Anything else (a class, an async function or ``@queue`` handler, a function that
    needs arguments or returns something else) is refused without being called on a guess.
    """
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        _fail(ExitCode.USAGE, f"expected module:attribute (for example myservice:consumer), got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            _fail(ExitCode.USAGE, f"cannot import {module_name!r}: no such module (run from your project's root)")
        _fail(ExitCode.USAGE, f"importing {module_name!r} failed: {exc}")
    except Exception as exc:
        _fail(ExitCode.USAGE, f"importing {module_name!r} failed: {type(exc).__name__}: {exc}")
    value = getattr(module, attribute, None)
    if value is None:
        _fail(ExitCode.USAGE, f"module {module_name!r} has no attribute {attribute!r}")
    if isinstance(value, Consumer):
        return value
    expected = "give a lily_mongo.Consumer, or a function taking no arguments that returns one"
    if isinstance(value, type):
        _fail(ExitCode.USAGE, f"{target} is a class ({value.__name__}), not a lily_mongo.Consumer; {expected}")
    if routes_of(value):
        _fail(ExitCode.USAGE, f"{target} is a @queue handler, not a lily_mongo.Consumer; {expected}")
    if inspect.iscoroutinefunction(value) or inspect.isasyncgenfunction(value):
        _fail(ExitCode.USAGE, f"{target} is an async function, not a lily_mongo.Consumer; {expected}")
    if not (inspect.isfunction(value) or inspect.ismethod(value) or isinstance(value, functools.partial)):
        _fail(ExitCode.USAGE, f"{target} is a {type(value).__name__}, not a lily_mongo.Consumer; {expected}")
    required = [
        p.name
        for p in inspect.signature(value).parameters.values()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        _fail(ExitCode.USAGE, f"{target} needs arguments ({', '.join(required)}); {expected}")
    try:
        made = value()
    except Exception as exc:
        _fail(ExitCode.USAGE, f"calling {target}() failed: {type(exc).__name__}: {exc}")
    if inspect.isawaitable(made):
        if inspect.iscoroutine(made):
            made.close()
        _fail(ExitCode.USAGE, f"{target}() returned an awaitable, not a lily_mongo.Consumer; {expected}")
    if not isinstance(made, Consumer):
        _fail(ExitCode.USAGE, f"{target}() returned {describe_value(made)}, not a lily_mongo.Consumer; {expected}")
    return made


def _consumer_urls(consumer: Consumer | None) -> str | None:
    return consumer.settings.amqp_url if consumer is not None else None


# -- run, asyncapi, demo -----------------------------------------------------------------------------


@app.command(epilog=EXIT_CODES)
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
    settings = ctx.find_object(_Settings)
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
        with _reported(ctx):
            if not reload:  # one clear error for a bad target, before any worker starts
                load_consumer(target)
            code = asyncio.run(supervise(options))
        raise typer.Exit(code)

    consumer: Consumer | None = None
    with _reported(ctx):
        consumer = load_consumer(target)
    hints: dict[str | None, str] = {None: "is it running? Check the consumer's amqp_url"}
    with _reported(ctx, _consumer_urls(consumer), hints=hints):
        link = _WorkerLink.open(worker_fd) if worker_fd is not None else None
        code = asyncio.run(_run_consumer(consumer, http_host, http_port, as_json, link, worker_index))
    raise typer.Exit(code)


async def _run_consumer(
    consumer: Consumer,
    http_host: str,
    http_port: int | None,
    as_json: bool,
    link: _WorkerLink | None,
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
        probes = await _start_probes(http_host, http_port) if http_port is not None else None
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
    _print_report(report, as_json, worker_index)
    # Non-zero when anything is unresolved or unobserved, and when the graceful
    # window did not suffice (a forced shutdown), so supervisors notice.
    return ExitCode.OK if report.graceful else ExitCode.FAILED


def _print_report(report: ShutdownReport, as_json: bool, worker_index: int | None) -> None:
    """The shutdown report: its text on stdout, or one JSON object on stderr with ``--log-format json``."""
    if as_json:
        fields = {
            "succeeded": report.succeeded,
            "forced": report.forced,
            "graceful": report.graceful,
            "unresolved": report.unresolved,
            "settled": dict(report.settled),
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


class _WorkerLink:
    """A ``--workers`` process's line to its supervisor: a socket it inherited (``--worker-fd``).

    The worker reports on it (its probe port, that it runs); the supervisor's end closing
    means the supervisor is gone, and the worker then shuts down gracefully.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    @classmethod
    def open(cls, fd: int) -> _WorkerLink:
        try:
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            raise CommandError(ExitCode.USAGE, f"--worker-fd {fd} is not a socket: {exc}") from exc
        sock.setblocking(False)
        return cls(sock)

    def send(self, message: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # the supervisor is gone: wait_closed says so
            self._sock.send(json.dumps(message).encode() + b"\n")

    async def wait_closed(self, signals: ShutdownSignals) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                data = await loop.sock_recv(self._sock, 512)
            except OSError:
                data = b""
            if not data:
                break
        if not signals.received:
            say.warning("the worker supervisor is gone: shutting down")
            signals.receive(signal.SIGTERM)  # as a SIGTERM would


@app.command(epilog=EXIT_CODES)
def relay(
    ctx: typer.Context,
    database: Annotated[
        str, typer.Option("--database", envvar="LILY_MONGO_DATABASE", help="The database holding the outbox.")
    ],
    mongo_uri: MongoOption = DEFAULT_MONGO_URI,
    amqp_url: AmqpOption = DEFAULT_AMQP_URL,
    collection: Annotated[str, typer.Option(help="The outbox collection (OutboxOptions.collection).")] = "lily_outbox",
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
    settings = ctx.find_object(_Settings)
    try:
        configure_logging(log_level, log_format, debug=settings is not None and settings.debug)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc

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
        probes = await _start_probes(http_host, http_port) if http_port is not None else None
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
        _print_report(report, log_format == "json", None)
        return ExitCode.OK if report.graceful else ExitCode.FAILED

    with _reported(ctx, amqp_url, mongo_uri, unreachable="is it running? Check --amqp-url and --mongo-uri"):
        code = asyncio.run(main())
    raise typer.Exit(code)


async def _start_probes(host: str, port: int) -> ProbeServer:
    """The /healthz, /readyz and /metrics server (the ``http`` extra), listening before the consumer starts."""
    try:
        from .probes import ProbeServer  # optional dependencies: imported only when asked for
    except ModuleNotFoundError as exc:
        _fail(ExitCode.USAGE, f"--http-port needs the 'http' extra: pip install 'lily-mongo[http]' ({exc})")
    probes = ProbeServer(host, port)
    try:
        await probes.start()
    except OSError as exc:
        await probes.stop()
        _fail(ExitCode.USAGE, f"cannot listen on {host}:{port}: {bind_reason(exc, host)}")
    return probes


@app.command(epilog=EXIT_CODES)
def asyncapi(
    ctx: typer.Context,
    target: Annotated[str, typer.Argument(help="module:consumer")],
    fmt: Annotated[str, typer.Option("--format", help="json or yaml")] = "yaml",
) -> None:
    """Print the AsyncAPI 3.0 document of a consumer's handlers and declared outgoing messages."""
    with _reported(ctx):
        if fmt not in ("json", "yaml"):
            _fail(ExitCode.USAGE, f"--format must be json or yaml, got {fmt!r}")
        consumer = load_consumer(target)
        document = asyncapi_document(consumer.plan(), outgoing=consumer.outgoing)
    if fmt == "json":
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    else:
        sys.stdout.write(yaml.safe_dump(document, sort_keys=False, allow_unicode=True))


@app.command(epilog=EXIT_CODES)
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
    _err(f"orders demo: {orders} orders, RabbitMQ {redact_url(amqp_url)}, MongoDB: {where}")
    with (
        _reported(ctx, amqp_url, mongo_uri),
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
    console.print(_demo_legend(result), markup=False, highlight=False)
    for problem in result.ledger_problems:
        console.print(f"[red]ledger:[/] {problem}")
    if result.shutdown is not None and not result.shutdown.succeeded:
        console.print(result.shutdown.render())
    raise typer.Exit(ExitCode.OK if result.ledger_ok else ExitCode.FAILED)


def _demo_legend(result: DemoResult) -> Table:
    """What the demo's counters mean: a term and its meaning a row, wrapped to the console's width."""
    duplicates = result.published_messages - result.orders - result.poison
    replays = f"attempts re-run after a transient error ({result.injected_failures} injected) or a failed commit"
    if result.emulator:
        replays += (
            "; on the embedded emulator most come from its global write conflicts: any write between a "
            "transaction's first operation and its commit fails that commit (docs/emulator.md)"
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


# -- dlq ---------------------------------------------------------------------------------------------

_DLQ_COLUMNS: tuple[tuple[str, Callable[[Any], object]], ...] = (
    ("event id", lambda m: m.event_id or "-"),
    ("origin", lambda m: m.origin),
    ("code", lambda m: m.display_code()),
    ("reason", lambda m: m.reason or "-"),
    ("failed at", lambda m: m.failed_at or "-"),
    ("retries", lambda m: "-" if m.retry_count is None else m.retry_count),
    ("bytes", lambda m: m.bytes),
)


_WIDE_TABLE = 140  # below this width the DLQ listing is one block per message, not a table


def _print_listing(listing: DlqListing, as_json: bool, wide: bool = False) -> None:
    summary = (
        f"{listing.dlq}: {listing.total} message(s), {len(listing.messages)} listed "
        "(each put back at the end of the queue)"
    )
    if as_json:
        for message in listing.messages:
            sys.stdout.write(json.dumps(message.as_json()) + "\n")
        _err(summary)
        return
    if wide or console.width >= _WIDE_TABLE:
        table = Table(title=summary, show_lines=False)
        for name, _ in _DLQ_COLUMNS:
            # Whole values: an event id is never cut; long cells fold onto more lines.
            table.add_column(name, overflow="fold", min_width=36 if name == "event id" else None)
        for message in listing.messages:
            table.add_row(*(str(cell(message)) for _, cell in _DLQ_COLUMNS))
        console.print(table)
    else:
        # A narrow terminal: a table of seven columns would squeeze every cell, so each message is
        # a block whose lines wrap at the terminal's width (--wide forces the table, --json is whole).
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
        _err("some messages' metadata was not valid UTF-8 and is shown as read leniently (--json: 'malformed')")


@dlq_app.command("list", epilog=EXIT_CODES)
def dlq_list(
    ctx: typer.Context,
    queue: Annotated[str, typer.Argument(help="The work queue (its DLQ is QUEUE.dlq).")],
    amqp_url: AmqpOption = DEFAULT_AMQP_URL,
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="List at most this many messages.")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per message and line.")] = False,
    wide: Annotated[
        bool, typer.Option("--wide", help="A table whatever the terminal's width (else below 140 columns, blocks).")
    ] = False,
) -> None:
    """List dead-lettered messages, oldest first, leaving them in the DLQ (moved to its end).

    The origin column tells library copies (the consumer wrote the failure code) from broker
    dead letters (RabbitMQ moved the original, e.g. an oversize body); a failure code the
    evidence does not back is shown as untrusted.
    """
    with _reported(ctx, amqp_url, unreachable=_AMQP_HINT):
        listing = asyncio.run(list_dead_letters(amqp_url, queue, limit=limit))
    _print_listing(listing, as_json, wide)


@dlq_app.command("replay", epilog=EXIT_CODES)
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
    with _reported(ctx, amqp_url, unreachable=_AMQP_HINT):
        if replay_all and event_id:
            _fail(ExitCode.USAGE, "give --event-id or --all, not both (--all would replay every message)")
        if not replay_all and not event_id:
            _fail(ExitCode.USAGE, "give --event-id (repeatable) or --all")
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
            _fail(
                ExitCode.FAILED,
                f"no message in {queue}.dlq carries event id {', '.join(result.missing)} "
                f"({result.scanned} message(s) inspected)",
            )


# -- inbox -------------------------------------------------------------------------------------------


@inbox_app.command("stats", epilog=EXIT_CODES)
def inbox_stats(
    ctx: typer.Context,
    database: Annotated[str, typer.Argument(help="The consumer's database.")],
    mongo_uri: MongoOption = DEFAULT_MONGO_URI,
    records: Annotated[str, typer.Option(help="The inbox record collection (InboxOptions.records).")] = "lily_inbox",
    outbox: Annotated[str, typer.Option(help="The outbox collection (OutboxOptions.collection).")] = "lily_outbox",
    timeout: Annotated[
        float, typer.Option(min=0.1, max=600, help="Seconds to wait for a MongoDB server to answer.")
    ] = 10.0,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Completed records, live and expired leases, outbox pending/published/failed, per handler."""
    options = InboxOptions(records=records)
    outbox_options = OutboxOptions(collection=outbox)

    async def main() -> dict[str, dict[str, int]]:
        client = await open_mongo(mongo_uri, timeout=timeout)
        try:
            with mongo_errors("reading the inbox statistics", uri=mongo_uri):
                present = set(await client[database].list_collection_names())
                if records not in present and outbox not in present:
                    _fail(
                        ExitCode.USAGE,
                        f"database {database!r} has neither a {records!r} nor an {outbox!r} collection: is it the "
                        "consumer's database? (a consumer with a mongo_client creates them when it starts)",
                    )
                return await read_inbox_stats(client[database], options, outbox=outbox_options.collection)
        finally:
            await client.close()

    with _reported(ctx, mongo_uri, hints={MONGODB: _MONGO_HINT}):
        stats = asyncio.run(main())
    if as_json:
        sys.stdout.write(json.dumps(stats, indent=2, sort_keys=True) + "\n")
        return
    table = Table(title=f"inbox statistics: {database}")
    table.add_column("handler", overflow="fold", ratio=1)
    for column in STAT_COLUMNS:
        # Two-line headers ("outbox" over "published") keep the table within 80 columns.
        table.add_column(column.replace("_", "\n"), justify="right", no_wrap=True)
    for handler, values in sorted(stats.items()):
        table.add_row(handler, *(str(values[c]) for c in STAT_COLUMNS))
    if not stats:
        console.print(f"inbox statistics: {database}: no records and no outbox records yet")
        return
    console.print(table)


# -- embedded --------------------------------------------------------------------------------------


@app.command(epilog=EXIT_CODES)
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

    with _reported(ctx):
        if not available():
            _fail(ExitCode.USAGE, "the embedded server needs the 'embedded' extra: pip install 'lily-mongo[embedded]'")
        if data is not None:
            try:
                data.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                _fail(ExitCode.USAGE, f"--data {data}: cannot use it as a directory ({exc.strerror or exc})")

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
                _fail(ExitCode.USAGE, f"cannot listen on {host}:{port}: {bind_reason(exc, host)}")
            finally:
                uninstall()

        asyncio.run(main())


def main() -> None:
    """Console-script entry point: the package's warnings on stderr, one per line, then the command.

    A usage error (an unknown option, a missing argument, a value out of range) is one
    ``error:`` line naming the command's ``--help``, with exit status 2.
    """
    configure_logging()
    command = typer.main.get_command(app)
    try:
        code = command.main(prog_name="lily-mongo", standalone_mode=False)
    except typer.TyperException as exc:  # typer's own click: UsageError and the others derive from it
        context = getattr(exc, "ctx", None)
        if not exc.format_message().strip():
            pass  # a command given no arguments: its help is what was asked for, and is printed already
        elif exc.exit_code == ExitCode.USAGE:
            where = context.command_path if context is not None else "lily-mongo"
            _err(f"{exc.format_message()} (see {where} --help)", level=logging.ERROR)
        else:
            _err(exc.format_message(), level=logging.ERROR)
        code = exc.exit_code
    except typer.Abort:
        _err("interrupted", level=logging.WARNING)
        code = ExitCode.INTERRUPTED
    raise SystemExit(code if isinstance(code, int) else ExitCode.OK)
