"""Publishing: the one place that publishes, mandatory and confirmed, with LongInt retry counts.

* the message properties are :class:`~.properties.LilyProperties` (``x-retry-count`` as LongInt);
* :func:`basic_publish` / :func:`publish_properties` publish mandatory on a
  confirming channel and return once the broker confirmed; every failure is a
  :class:`PublishError` (:func:`publish_error`).
* :func:`republish` publishes a copy of a delivery: the retry/DLQ handoff and the DLQ replay.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiormq.abc
from pamqp import commands as spec

from .._errors import PublishError
from .errors import AmqpFailure, map_amqp_errors
from .properties import LilyProperties

if TYPE_CHECKING:
    import aio_pika.abc

    from .inbound import AmqpMessage

__all__ = [
    "basic_publish",
    "publish_error",
    "publish_properties",
    "republish",
]


def publish_error(failure: AmqpFailure, exc: BaseException, *, where: str, timeout: float) -> PublishError:
    """The :class:`PublishError` for a publish to ``where`` that failed so (any other failure: ``closed``)."""
    if failure is AmqpFailure.UNROUTABLE:
        return PublishError("unroutable", f"{where}: returned by the broker as unroutable")
    if failure is AmqpFailure.NACKED:
        return PublishError("nacked", f"{where}: the broker nacked the message")
    if failure is AmqpFailure.TIMEOUT:
        return PublishError("timeout", f"{where}: no publisher confirm within {timeout:g} s")
    return PublishError("closed", f"{where}: channel failed ({type(exc).__name__})")


async def basic_publish(
    channel: aiormq.abc.AbstractChannel,
    *,
    exchange: str,
    routing_key: str,
    body: bytes,
    headers: Mapping[str, Any],
    content_type: str | None,
    timeout: float,
    persistent: bool = True,
    expiration: str | None = None,
    properties: Mapping[str, Any] | None = None,
) -> None:
    """Publish mandatory on a confirming channel; return only once the broker confirmed.

    Raises :class:`PublishError` with kind ``unroutable`` (basic.return),
    ``nacked`` (basic.nack), ``timeout`` (no confirm in ``timeout`` seconds) or
    ``closed`` (the channel or connection failed).
    """
    frame_properties = LilyProperties(
        **(properties or {}),
        content_type=content_type,
        headers=dict(headers),
        delivery_mode=2 if persistent else 1,
        # A fresh id per publication: aiormq matches basic.return frames to
        # publishes by message_id, so copies of one event must not share it.
        message_id=uuid.uuid4().hex,
        expiration=expiration,
    )
    await publish_properties(
        channel, exchange=exchange, routing_key=routing_key, body=body, properties=frame_properties, timeout=timeout
    )


async def publish_properties(
    channel: aiormq.abc.AbstractChannel,
    *,
    exchange: str,
    routing_key: str,
    body: bytes,
    properties: LilyProperties,
    timeout: float,
) -> None:
    """:func:`basic_publish` with every AMQP property given: mandatory, confirmed, errors mapped."""
    where = f"exchange {exchange!r} routing key {routing_key!r}"
    try:
        properties.marshal()  # encode now, so a bad header fails here, not in the writer
    except (TypeError, ValueError) as exc:
        raise PublishError("invalid", f"{where}: the message cannot be encoded as AMQP: {exc}"[:300]) from exc
    with map_amqp_errors(lambda failure, exc: publish_error(failure, exc, where=where, timeout=timeout)):
        confirmation = await channel.basic_publish(
            body,
            exchange=exchange,
            routing_key=routing_key,
            properties=properties,
            mandatory=True,
            timeout=timeout,
        )
    if not isinstance(confirmation, spec.Basic.Ack):
        raise PublishError("nacked", f"{where}: no publisher confirm (got {type(confirmation).__name__})")


# Properties a copy keeps from the original. Not message_id (a fresh one is
# needed, see above), not expiration (a retry copy must not expire on the way),
# not user_id (the broker checks it against the publishing connection's user).
_COPIED_PROPERTIES = ("correlation_id", "reply_to", "app_id", "content_encoding", "priority", "timestamp", "type")


async def republish(
    channel: aiormq.abc.AbstractChannel,
    message: aio_pika.abc.AbstractIncomingMessage | AmqpMessage,
    *,
    routing_key: str,
    headers: Mapping[str, Any],
    timeout: float,
) -> None:
    """Publish a copy of ``message`` (same body and properties, given headers) through the default
    exchange to ``routing_key``, mandatory and confirmed: the retry/DLQ handoff and the DLQ replay."""
    kept = {name: getattr(message, name) for name in _COPIED_PROPERTIES if getattr(message, name, None) is not None}
    if "type" in kept:
        kept["message_type"] = kept.pop("type")
    await basic_publish(
        channel,
        exchange="",
        routing_key=routing_key,
        body=message.body,
        headers=headers,
        content_type=message.content_type,
        timeout=timeout,
        properties=kept,
    )
