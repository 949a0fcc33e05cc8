"""Handlers every tier uses: one that accepts, one that refuses, and one with a parameter of each
built-in kind, with the order payload it decodes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pydantic

from lily_mongo import EventId, Json, MongoScope, QueueHandlerError, RawDelivery, Redelivered, RetryCount, queue


def accepting(q: str) -> Callable[..., Awaitable[None]]:
    """A json v1 handler on ``q`` that accepts every delivery and does nothing."""

    @queue(q, version=1, content="json")
    async def accept(body: Json[dict[str, Any]]) -> None:
        return None

    return accept


def rejecting(q: str) -> Callable[..., Awaitable[None]]:
    """A json v1 handler on ``q`` that refuses every delivery it decodes, permanently (``ITEM_REJECTED``)."""

    @queue(q, version=1, content="json")
    async def reject(body: Json[dict[str, Any]]) -> None:
        raise QueueHandlerError.permanent("ITEM_REJECTED", "refused by the handler")

    return reject


class Order(pydantic.BaseModel):
    """The payload of the plans and deliveries the unit tier builds (``{"order_id": 7, "lines": [...]}``)."""

    order_id: int
    lines: list[str]


def taking_every_kind(received: dict[str, Any]) -> Callable[..., Awaitable[None]]:
    """A handler with one parameter of each built-in kind (its MongoScope keyword-only) that keeps what
    it receives in ``received``, by parameter name."""

    async def on_order(
        order: Json[Order],
        event_id: EventId,
        retries: RetryCount,
        redelivered: Redelivered,
        raw: RawDelivery,
        *,
        mongo: MongoScope,
    ) -> None:
        received.update(order=order, event_id=event_id, retries=retries, redelivered=redelivered, raw=raw, mongo=mongo)

    return on_order
