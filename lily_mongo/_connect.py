"""Connection helpers shared by the publisher, the consumer and the CLI."""

from __future__ import annotations

import contextlib
import re

import aio_pika
import aio_pika.abc
import aiormq.exceptions
from aio_pika.connection import make_url

from ._tasks import uncancellable
from .errors import TransportError

__all__ = ["connect_amqp", "redact_url"]

_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:@/]*)(?::[^@/]*)?@")


def redact_url(url: str) -> str:
    """Replace the password in a URL with ``***`` so it can appear in logs and reports."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", url)


async def connect_amqp(url: str, *, robust: bool = True) -> aio_pika.abc.AbstractConnection:
    """Open an AMQP connection (robust by default: it reconnects and restores topology).

    Cancelling the caller while the connection is being opened closes it: a robust
    connection starts background tasks that would otherwise outlive the caller.
    """
    connection: aio_pika.abc.AbstractConnection = (
        aio_pika.RobustConnection(make_url(url)) if robust else aio_pika.Connection(make_url(url))
    )
    try:
        await connection.connect()
    except BaseException as exc:
        with contextlib.suppress(Exception):
            await uncancellable(connection.close())
        if isinstance(exc, aiormq.exceptions.AMQPError | OSError | TimeoutError):
            raise TransportError(
                f"cannot connect to RabbitMQ at {redact_url(url)}: {type(exc).__name__}: {exc}"[:500]
            ) from exc
        raise
    return connection
