"""How a command ends: its exit status, and an error reported as one line (the traceback with ``--debug``),
passwords masked (docs/operations.md, section 8)."""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import typer

from .._errors import ConfigError, LilyError, PublishError, TransportError
from .._redact import scrub
from .exit_codes import ExitCode
from .logs import COMMAND_LOGGER

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class Settings:
    debug: bool


say = logging.getLogger(COMMAND_LOGGER)  # the command's own lines: plain as text, one object each as JSON


class CommandError(Exception):
    """An error a command reports as one line, with its exit status."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def classify(exc: BaseException, hints: dict[str | None, str] | None = None) -> tuple[ExitCode, str]:
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
def reported(
    ctx: typer.Context, *urls: str | None, unreachable: str = "", hints: dict[str | None, str] | None = None
) -> Iterator[None]:
    """End the command on any error with one line (and the traceback with --debug), passwords masked.

    ``unreachable`` is the advice appended when nothing answered at a RabbitMQ URL; ``hints``
    gives it by party (``{"MongoDB": ...}``, see :func:`classify`).
    """
    try:
        yield
    except (typer.Exit, typer.Abort, typer.TyperException):
        raise
    except KeyboardInterrupt:
        tell("interrupted", level=logging.WARNING)
        raise typer.Exit(ExitCode.INTERRUPTED) from None
    except Exception as exc:
        code, message = classify(exc, {None: unreachable, **(hints or {})} if unreachable else hints)
        settings = ctx.find_object(Settings)
        trace = None
        if settings is not None and settings.debug:
            trace = scrubbed("".join(traceback.format_exception(exc)).rstrip(), urls)
        tell(message, urls, level=logging.ERROR, traceback=trace)
        raise typer.Exit(code) from None


def scrubbed(text: str, urls: tuple[str | None, ...]) -> str:
    for url in urls:
        if url:
            text = scrub(text, url)
    return text


def tell(
    text: str, urls: tuple[str | None, ...] = (), *, level: int = logging.INFO, traceback: str | None = None
) -> None:
    """One of the command's own lines on stderr (an ``error:`` line at ERROR), passwords masked."""
    say.log(level, "%s", scrubbed(text, urls), extra={"traceback": traceback} if traceback else None)


def fail(code: ExitCode, message: str) -> NoReturn:
    raise CommandError(code, message)
