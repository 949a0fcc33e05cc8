"""Test your handlers without RabbitMQ: the real pipeline in-process, fault injection, an idempotence check.

:class:`TestConsumer` runs a :class:`~lily_mongo.Consumer`'s own plan through the
same engine a started consumer uses (envelope validation, dispatch, extractors,
middleware and guards, the inbox protocol against the consumer's MongoDB, the
settlement loop); only the AMQP transport is replaced. What would have been
published (retry copies, DLQ copies, outbox messages: dispatched right after
their commit, as a started consumer does) is recorded in
:attr:`TestConsumer.published`::

    async with TestConsumer(consumer) as tc:
        result = await tc.publish_json("orders.created", {"order_id": "o1"}, version=1)
        assert result.outcome == "acked"

:class:`Faults` injects MongoDB's own failures with ``configureFailPoint``
(``failCommand``), and :func:`check_idempotent` proves that duplicates,
concurrent copies and faulted attempts leave the database as one clean
delivery per event would.
"""

from __future__ import annotations

from ._consumer import TestConsumer
from ._faults import FaultInjectionUnsupported, Faults
from ._idempotence import check_idempotent
from ._results import DeliveryResult, PublishedMessage

__all__ = [
    "DeliveryResult",
    "FaultInjectionUnsupported",
    "Faults",
    "PublishedMessage",
    "TestConsumer",
    "check_idempotent",
]
