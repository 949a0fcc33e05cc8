"""The ``lily-mongo`` command: run, relay, demo, asyncapi, dlq, inbox, embedded.

A thin shell: each command (``run``, ``relay``, ``dlq``, ``tools``) parses its options,
calls the package and prints the result; ``workers`` runs ``run --workers`` and
``--reload``, ``probes`` serves ``--http-port``. Errors end the command with one line
on stderr saying what failed and what to do, and a documented exit status
(``errors``; usage errors too: one ``error:`` line, status 2); ``--debug`` adds the
traceback (never local variables, and with passwords masked). The command's own
lines go through the ``lily_mongo.cli`` logger (``logs``), so ``run --log-format
json`` writes nothing but JSON objects on stderr.

Needs the ``cli`` extra (``pip install 'lily-mongo[cli]'``): typer for the
commands, rich for progress and tables, PyYAML for YAML output.
"""

from __future__ import annotations

import logging
import sys
from typing import Annotated

try:
    import rich  # noqa: F401 - the commands' tables and progress display
    import typer
    import yaml  # noqa: F401 - asyncapi's YAML output
except ModuleNotFoundError as exc:  # pragma: no cover - exercised only without the extra
    print(f"lily-mongo needs the 'cli' extra: pip install 'lily-mongo[cli]' ({exc.name} is missing)", file=sys.stderr)
    raise SystemExit(2) from exc

from . import dlq, relay, run, tools
from .errors import Settings, tell
from .exit_codes import EXIT_CODES, ExitCode
from .helptext import tidy
from .logs import configure_logging
from .options import version

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


def _print_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"lily-mongo {version()}\n")
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
    ctx.obj = Settings(debug=debug)
    # The package's warnings (with --debug its INFO lines too); `run` sets its own level and format.
    configure_logging("info" if debug else "warning", debug=debug)


def main() -> None:
    """Console-script entry point: the package's warnings on stderr, one per line, then the command.

    A usage error (an unknown option, a missing argument, a value out of range) is one
    ``error:`` line naming the command's ``--help``, with exit status 2.
    """
    configure_logging()
    command = typer.main.get_command(app)
    tidy(command)
    try:
        code = command.main(prog_name="lily-mongo", standalone_mode=False)
    except typer.TyperException as exc:  # typer's own click: UsageError and the others derive from it
        context = getattr(exc, "ctx", None)
        if not exc.format_message().strip():
            pass  # a command given no arguments: its help is what was asked for, and is printed already
        elif exc.exit_code == ExitCode.USAGE:
            where = context.command_path if context is not None else "lily-mongo"
            tell(f"{exc.format_message()} (see {where} --help)", level=logging.ERROR)
        else:
            tell(exc.format_message(), level=logging.ERROR)
        code = exc.exit_code
    except typer.Abort:
        tell("interrupted", level=logging.WARNING)
        code = ExitCode.INTERRUPTED
    raise SystemExit(code if isinstance(code, int) else ExitCode.OK)


# The commands, registered in the order ``--help`` lists them.
app.command(epilog=EXIT_CODES)(run.run)
app.command(epilog=EXIT_CODES)(relay.relay)
app.command(epilog=EXIT_CODES)(tools.asyncapi)
app.command(epilog=EXIT_CODES)(tools.demo)
dlq_app.command("list", epilog=EXIT_CODES)(dlq.dlq_list)
dlq_app.command("replay", epilog=EXIT_CODES)(dlq.dlq_replay)
inbox_app.command("stats", epilog=EXIT_CODES)(tools.inbox_stats)
app.command(epilog=EXIT_CODES)(tools.embedded)
