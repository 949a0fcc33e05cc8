"""lily_mongo: RabbitMQ consumers whose handlers run once per event inside MongoDB transactions.

The public surface (docs/design.md, section 2); implementation modules may change.

``import lily_mongo`` loads only the exception tree: every other name is imported the first
time it is used (``from lily_mongo import Consumer`` loads the consumer, PyMongo and aio-pika),
so a command that needs none of them (``lily-mongo --version``) does not pay for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._errors import (
    CommitOutcomeUnknown,
    ConfigError,
    EnvelopeError,
    ErrorCode,
    LilyError,
    PlanError,
    PublishError,
    QueueHandlerError,
    ScopeClosedError,
    TransportError,
)

if TYPE_CHECKING:
    from ._inbox import InboxOptions, MongoDatabase, MongoScope
    from ._lifecycle import Consumer, ManagedConsumer
    from ._outbox import Outbox, OutboxOptions, OutboxTransaction, Relay
    from ._plan.batch import Batch, BatchEntry, BatchItemFailed, BatchOptions
    from ._plan.extractors import Bytes, EventId, Extractor, Json, RawDelivery, Redelivered, RetryCount, Text
    from ._plan.options import QueueOptions, RetryPolicy
    from ._plan.parameters import Depends, Resource
    from ._plan.routes import DeliveryContext, queue
    from ._snapshots import QueueSnapshot, Snapshot, TerminalObservation
    from ._supervision import ShutdownAction, ShutdownReport
    from .publisher import CustomPublishContent, Publisher

# Where each lazily imported name lives: loaded on first use, then kept in the module's namespace.
_LAZY = {
    "Batch": "._plan.batch",
    "BatchEntry": "._plan.batch",
    "BatchItemFailed": "._plan.batch",
    "BatchOptions": "._plan.batch",
    "Bytes": "._plan.extractors",
    "Consumer": "._lifecycle",
    "CustomPublishContent": ".publisher",
    "DeliveryContext": "._plan.routes",
    "Depends": "._plan.parameters",
    "EventId": "._plan.extractors",
    "Extractor": "._plan.extractors",
    "InboxOptions": "._inbox",
    "Json": "._plan.extractors",
    "ManagedConsumer": "._lifecycle",
    "MongoDatabase": "._inbox",
    "MongoScope": "._inbox",
    "Outbox": "._outbox",
    "OutboxOptions": "._outbox",
    "OutboxTransaction": "._outbox",
    "Publisher": ".publisher",
    "QueueOptions": "._plan.options",
    "QueueSnapshot": "._snapshots",
    "RawDelivery": "._plan.extractors",
    "Redelivered": "._plan.extractors",
    "Relay": "._outbox",
    "Resource": "._plan.parameters",
    "RetryCount": "._plan.extractors",
    "RetryPolicy": "._plan.options",
    "ShutdownAction": "._supervision",
    "ShutdownReport": "._supervision",
    "Snapshot": "._snapshots",
    "TerminalObservation": "._snapshots",
    "Text": "._plan.extractors",
    "queue": "._plan.routes",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "Batch",
    "BatchEntry",
    "BatchItemFailed",
    "BatchOptions",
    "Bytes",
    "CommitOutcomeUnknown",
    "ConfigError",
    "Consumer",
    "CustomPublishContent",
    "DeliveryContext",
    "Depends",
    "EnvelopeError",
    "ErrorCode",
    "EventId",
    "Extractor",
    "InboxOptions",
    "Json",
    "LilyError",
    "ManagedConsumer",
    "MongoDatabase",
    "MongoScope",
    "Outbox",
    "OutboxOptions",
    "OutboxTransaction",
    "PlanError",
    "PublishError",
    "Publisher",
    "QueueHandlerError",
    "QueueOptions",
    "QueueSnapshot",
    "RawDelivery",
    "Redelivered",
    "Relay",
    "Resource",
    "RetryCount",
    "RetryPolicy",
    "ScopeClosedError",
    "ShutdownAction",
    "ShutdownReport",
    "Snapshot",
    "TerminalObservation",
    "Text",
    "TransportError",
    "queue",
]
