"""lily_mongo: RabbitMQ consumers whose handlers run once per event inside MongoDB transactions.

The public surface (docs/design.md, section 2); implementation modules may change.
"""

from __future__ import annotations

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
