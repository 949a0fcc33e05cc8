"""Every AMQP client error the package meets, mapped to a lily error at one boundary.

:data:`AMQP_ERRORS` says, for each aiormq / aio-pika / socket exception class,
what happened (an :class:`AmqpFailure`); the most specific class of an
exception's type that the table names decides. Each kind of operation turns
that into its own lily error with its own sentence: connecting
(:func:`lily_mongo._amqp.connections.connection_error`), publishing
(:func:`lily_mongo._amqp.publishing.publish_error`), and every other channel
operation (:func:`channel_error`: declarations, reading a queue, settling).
:func:`map_amqp_errors` is the ``with`` block that applies one of them, like
httpx's ``map_exceptions``. An exception the table does not name (a bug, a
cancellation) passes through unchanged. docs/operations.md, section 8, lists
what each becomes.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

import aiormq.exceptions

from .._errors import ConfigError, LilyError, TransportError

__all__ = ["AMQP_ERRORS", "AmqpFailure", "amqp_failure", "channel_error", "channel_errors", "map_amqp_errors"]


class AmqpFailure(enum.Enum):
    """What an AMQP client exception says happened."""

    LOGIN_REFUSED = "the broker refused the login"
    ACCESS_REFUSED = "the broker refused access (ACCESS_REFUSED)"
    NOT_FOUND = "no such queue or exchange (NOT_FOUND)"
    PRECONDITION_FAILED = "it exists with other arguments (PRECONDITION_FAILED)"
    UNROUTABLE = "the broker returned a mandatory message"
    NACKED = "the broker nacked a message"
    TIMEOUT = "no answer in time"
    NETWORK = "the connection's socket failed or nothing answered"
    CLOSED = "the channel or connection is closed"
    PROTOCOL = "a frame the client could not read"
    FAILED = "another AMQP error"


_E = aiormq.exceptions
AMQP_ERRORS: Mapping[type[BaseException], AmqpFailure] = MappingProxyType(
    {
        _E.AuthenticationError: AmqpFailure.LOGIN_REFUSED,
        _E.ProbableAuthenticationError: AmqpFailure.LOGIN_REFUSED,
        _E.ChannelAccessRefused: AmqpFailure.ACCESS_REFUSED,
        _E.ChannelNotFoundEntity: AmqpFailure.NOT_FOUND,
        _E.ChannelPreconditionFailed: AmqpFailure.PRECONDITION_FAILED,
        _E.PublishError: AmqpFailure.UNROUTABLE,  # basic.return (mandatory)
        _E.DeliveryError: AmqpFailure.NACKED,
        _E.ProtocolSyntaxError: AmqpFailure.PROTOCOL,  # InvalidFrameError included
        _E.ConnectionClosed: AmqpFailure.CLOSED,  # the broker closed the connection
        _E.AMQPConnectionError: AmqpFailure.NETWORK,  # how aiormq wraps the socket's errors
        _E.AMQPChannelError: AmqpFailure.CLOSED,  # ChannelClosed and the rest of its codes
        _E.ChannelInvalidStateError: AmqpFailure.CLOSED,
        _E.AMQPError: AmqpFailure.FAILED,
        asyncio.InvalidStateError: AmqpFailure.CLOSED,  # a future of a closed channel
        TimeoutError: AmqpFailure.TIMEOUT,
        OSError: AmqpFailure.NETWORK,  # ConnectionError (refused, reset) and socket.gaierror included
    }
)


def amqp_failure(exc: BaseException) -> AmqpFailure | None:
    """What ``exc`` says happened (its most specific class in :data:`AMQP_ERRORS`), or None.

    A plain ``Exception``, no subclass, is a closed channel's or connection's: aiormq rejects the
    futures still waiting on one closed without a reason (aio-pika's ``close()``) with ``Exception``.
    """
    if type(exc) is Exception:
        return AmqpFailure.CLOSED
    for cls in type(exc).__mro__:
        failure = AMQP_ERRORS.get(cls)
        if failure is not None:
            return failure
    return None


ToLily = Callable[[AmqpFailure, BaseException], LilyError]
"""Turns one failure of one operation into the lily error its caller raises."""


@contextlib.contextmanager
def map_amqp_errors(to_lily: ToLily) -> Iterator[None]:
    """Raise ``to_lily(failure, exc)`` from an exception the table names; let others through."""
    try:
        yield
    except Exception as exc:
        failure = amqp_failure(exc)
        if failure is None:
            raise
        raise to_lily(failure, exc) from exc


def _reply_text(exc: BaseException) -> str:
    text = exc.args[0] if exc.args and isinstance(exc.args[0], str) else ""
    return text[:200]


def channel_error(
    failure: AmqpFailure,
    exc: BaseException,
    *,
    what: str,
    not_found: str | None = None,
    precondition: str | None = None,
) -> LilyError:
    """The lily error for ``what`` (a channel operation: "declaring queue 'q'") that failed so.

    ``not_found`` and ``precondition`` replace the sentence of a :class:`ConfigError` the
    caller can word better (which queue, what to give instead); the broker's reply text
    follows a refused precondition.
    """
    if failure is AmqpFailure.NOT_FOUND:
        return ConfigError(not_found or f"{what}: the queue or exchange does not exist on the broker")
    if failure is AmqpFailure.PRECONDITION_FAILED:
        return ConfigError(f"{precondition or what + ': ' + AmqpFailure.PRECONDITION_FAILED.value}: {_reply_text(exc)}")
    if failure is AmqpFailure.ACCESS_REFUSED:
        return TransportError(f"RabbitMQ refused access ({what}): {_reply_text(exc) or 'ACCESS_REFUSED'}")
    return TransportError(f"{what} failed: {type(exc).__name__}")


def channel_errors(
    what: str, *, not_found: str | None = None, precondition: str | None = None
) -> contextlib.AbstractContextManager[None]:
    """``with channel_errors("declaring queue 'q'"):`` maps every error the table names (see :func:`channel_error`)."""
    return map_amqp_errors(
        lambda failure, exc: channel_error(failure, exc, what=what, not_found=not_found, precondition=precondition)
    )
