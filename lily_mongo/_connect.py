"""Connection helpers shared by the publisher, the consumer and the CLI."""

from __future__ import annotations

import re

import aio_pika
import aio_pika.abc

__all__ = ["connect_amqp", "redact_url"]

_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:@/]*)(?::[^@/]*)?@")


def redact_url(url: str) -> str:
    """Replace the password in a URL with ``***`` so it can appear in logs and reports."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", url)


async def connect_amqp(url: str, *, robust: bool = True) -> aio_pika.abc.AbstractConnection:
    """Open an AMQP connection (robust by default: it reconnects and restores topology)."""
    if robust:
        return await aio_pika.connect_robust(url)
    return await aio_pika.connect(url)
