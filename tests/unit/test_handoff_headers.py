"""The header table of a retry or DLQ copy (``settlement.handoff_headers``)."""

from __future__ import annotations

from lily_mongo._engine.settlement import Step, StepKind, handoff_headers


def test_a_copy_drops_the_broker_delivery_counters_and_keeps_the_rest() -> None:
    # A quorum queue counted three deliveries of the original; the retry copy is a new
    # message whose deliveries the broker counts afresh (a stale count would pass for
    # earlier deferrals of the copy, and make its first delivery look redelivered).
    original = {"x-event-id": "e-1", "x-delivery-count": 3, "x-acquired-count": 4, "tenant": "acme"}
    step = Step(StepKind.PUBLISH_RETRY, "PAYMENT_DOWN", "down", retry_count=1)
    headers = handoff_headers(original, step, retry_count=1, failed_queue="orders")
    assert "x-delivery-count" not in headers
    assert "x-acquired-count" not in headers
    assert (headers["x-event-id"], headers["tenant"], headers["x-retry-count"]) == ("e-1", "acme", 1)
    assert headers["x-lily-failure-code"] == "PAYMENT_DOWN"
    assert original["x-delivery-count"] == 3  # the original's table is not changed
