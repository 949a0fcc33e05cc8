"""lily_mongo: RabbitMQ consumers whose handlers run once per event inside MongoDB transactions."""

from __future__ import annotations

from .errors import (
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
from .publisher import CustomPublishContent, Publisher

__all__ = [
    "ConfigError",
    "CustomPublishContent",
    "EnvelopeError",
    "ErrorCode",
    "LilyError",
    "PlanError",
    "PublishError",
    "Publisher",
    "QueueHandlerError",
    "ScopeClosedError",
    "TransportError",
]
