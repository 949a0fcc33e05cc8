"""Queue topology per physical queue (docs/settlement.md, section 8).

For queue ``Q``: ``Q`` itself dead-letters broker-native rejections to
``Q.dlq`` through the default exchange; each distinct retry delay ``i`` is a
bucket ``Q.retry.<i>`` whose per-queue TTL dead-letters copies back to ``Q``;
``Q.dlq`` holds dead-lettered copies. Using the default exchange keeps the
topology to queues only: every derived name is a routing key as well.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import aio_pika.abc

from ._amqp import channel_errors
from ._errors import ConfigError
from ._plan.options import QueueOptions, RetryPolicy
from ._plan.outgoing import OutgoingMessage
from ._tasks import raise_if_cancel_requested

__all__ = ["declare_topology", "destination_options", "prepare_destinations", "topology_names"]

log = logging.getLogger("lily_mongo")


def topology_names(options: QueueOptions) -> list[str]:
    """Every queue name the topology of ``options`` uses: the queue, its buckets, its DLQ."""
    return [
        options.name,
        *(options.bucket_name(i) for i in range(len(options.retry.bucket_delays_ms))),
        options.dlq_name,
    ]


def _arguments(options: QueueOptions, extra: dict[str, Any]) -> dict[str, Any]:
    arguments = dict(extra)
    if options.queue_type == "quorum":
        arguments["x-queue-type"] = "quorum"
    return arguments


async def declare_topology(connection: aio_pika.abc.AbstractConnection, options: QueueOptions) -> None:
    """Declare (or, with ``passive=True``, verify) the queue, its retry buckets and its DLQ.

    Raises :class:`ConfigError` when an existing queue has different arguments
    (RabbitMQ's PRECONDITION_FAILED) or, in passive mode, is missing.
    """
    declarations: list[tuple[str, dict[str, Any]]] = [
        (options.dlq_name, _arguments(options, {})),
        (
            options.name,
            _arguments(options, {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": options.dlq_name}),
        ),
    ]
    for index, delay_ms in enumerate(options.retry.bucket_delays_ms):
        declarations.append(
            (
                options.bucket_name(index),
                _arguments(
                    options,
                    {
                        "x-message-ttl": delay_ms,
                        "x-dead-letter-exchange": "",
                        "x-dead-letter-routing-key": options.name,
                    },
                ),
            )
        )
    for name, arguments in declarations:
        # One channel per declaration: a refused declaration closes its channel.
        errors = channel_errors(
            f"declaring queue {name!r}",
            not_found=f"queue {name!r} does not exist (passive topology verification)",
            precondition=f"queue {name!r} exists with other arguments than {arguments!r}",
        )
        with errors:
            channel = await connection.channel(publisher_confirms=False)
            try:
                if options.passive:
                    await channel.declare_queue(name, passive=True)
                else:
                    await channel.declare_queue(name, durable=True, arguments=arguments)
            finally:
                if not channel.is_closed:
                    await channel.close()
        raise_if_cancel_requested()


def destination_options(message: OutgoingMessage) -> QueueOptions:
    """The queue ``declare=True`` creates for an outgoing message: a work queue with its DLQ, as a
    ``lily_mongo`` consumer with default queue options declares it (its retry buckets are its own)."""
    return QueueOptions(name=message.routing_key, retry=RetryPolicy(max_retries=0))


async def prepare_destinations(
    connection: aio_pika.abc.AbstractConnection, outgoing: Iterable[OutgoingMessage]
) -> None:
    """Declare the destinations marked ``declare=True``; warn about the others the broker has no
    route for yet (a missing queue or exchange), since their outbox records would be refused."""
    seen: set[tuple[str, str]] = set()
    for message in outgoing:
        destination = (message.exchange, message.routing_key)
        if destination in seen:
            continue
        seen.add(destination)
        if message.declare:
            await declare_topology(connection, destination_options(message))
            continue
        what = f"exchange {message.exchange!r}" if message.exchange else f"queue {message.routing_key!r}"
        try:
            with channel_errors(f"checking the outbox destination {what}"):
                channel = await connection.channel(publisher_confirms=False)
                try:
                    if message.exchange:
                        await channel.declare_exchange(message.exchange, passive=True)
                    else:
                        await channel.declare_queue(message.routing_key, passive=True)
                finally:
                    if not channel.is_closed:
                        await channel.close()
        except ConfigError:  # the table's NOT_FOUND (a passive declaration): a warning, not a failure
            log.warning(
                "the outbox destination %s does not exist: records sent to it are refused as unroutable until it is "
                "declared (by its consumer, or with sends(..., declare=True))",
                what,
            )
        raise_if_cancel_requested()
