"""Outbox records as a transaction's writer makes them, for the tests that drive the protocol directly."""

from __future__ import annotations

import datetime
from typing import Any

from lily_mongo._outbox import protocol


def written_record(
    record_id: str,
    *,
    written_at: datetime.datetime,
    seq: int = 0,
    claim: protocol.Claim | None = None,
    body: bytes = b"{}",
    headers: dict[str, Any] | None = None,
    content_type: str | None = "application/json",
) -> dict[str, Any]:
    """The record ``protocol.new_record`` makes of one message to ``down`` on the default exchange,
    written by ``w``; its event id is ``record_id``, and so is its header unless ``headers`` say."""
    return protocol.new_record(
        record_id=record_id,
        event_id=record_id,
        exchange="",
        routing_key="down",
        body=body,
        headers={"x-lily-event-id": record_id} if headers is None else headers,
        content_type=content_type,
        writer="w",
        written_at=written_at,
        seq=seq,
        claim=claim,
    )
