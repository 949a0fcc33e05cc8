"""Queue topology per physical queue (SPEC section 3).

For queue ``Q``: ``Q`` itself dead-letters broker-native rejections to
``Q.dlq`` through the default exchange; each distinct retry delay ``i`` is a
bucket ``Q.retry.<i>`` whose per-queue TTL dead-letters copies back to ``Q``;
``Q.dlq`` holds dead-lettered copies. Using the default exchange keeps the
topology to queues only: every derived name is a routing key as well.
"""

from __future__ import annotations

from typing import Any

import aio_pika.abc
import aiormq.exceptions

from ._tasks import raise_if_cancel_requested
from .errors import ConfigError, TransportError
from .plan import QueueOptions

__all__ = ["declare_topology", "topology_names"]


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
        channel = await connection.channel(publisher_confirms=False)
        try:
            if options.passive:
                await channel.declare_queue(name, passive=True)
            else:
                await channel.declare_queue(name, durable=True, arguments=arguments)
        except aiormq.exceptions.ChannelNotFoundEntity as exc:
            raise ConfigError(f"queue {name!r} does not exist (passive topology verification)") from exc
        except aiormq.exceptions.ChannelPreconditionFailed as exc:
            raise ConfigError(f"queue {name!r} exists with other arguments than {arguments!r}: {exc}") from exc
        except aiormq.exceptions.AMQPError as exc:
            raise TransportError(f"declaring queue {name!r} failed: {type(exc).__name__}") from exc
        finally:
            if not channel.is_closed:
                await channel.close()
        raise_if_cancel_requested()
