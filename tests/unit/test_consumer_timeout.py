"""The consumer timeout by design (docs/deployment.md, "Consumer timeout"): how long a delivery may stay
unacknowledged, the start-up warning when that could pass the broker's timeout, the cause a cancel is
reported with, and readiness while a queue has no consumer."""

from __future__ import annotations

from typing import Any

import pytest

from lily_mongo._engine.intake import AmqpIntake, QueueConsumer, cancel_cause
from lily_mongo._engine.queues import QueueState
from lily_mongo._plan.options import QueueOptions, consumer_timeout_warning, longest_unacked

SETTLE = 12.0  # a confirm timeout of 10 s and the 2 s pause before a requeue


def test_a_delivery_waits_for_the_permits_ahead_of_it_then_runs_and_settles() -> None:
    # 8 prefetched on 2 permits: 6 wait, in 3 turns of 30 + 5 s before the last one's own turn.
    options = QueueOptions(name="orders", concurrency=2, prefetch=8, deadline=30.0, cooperation_window=5.0)
    assert longest_unacked(options, SETTLE) == 4 * 35.0 + 12.0
    # The buffer, not the prefetch, bounds what waits: 2 running and 1 buffered.
    assert longest_unacked(QueueOptions(name="orders", concurrency=2, prefetch=8, buffer=1), 0.0) == 2 * 65.0
    # Nothing waits when every prefetched delivery has a permit.
    assert longest_unacked(QueueOptions(name="orders", concurrency=8, prefetch=8), 0.0) == 65.0


def test_a_configured_timeout_shorter_than_the_backlog_warns_naming_the_queue_and_figures() -> None:
    options = QueueOptions(name="orders", concurrency=2, prefetch=8, deadline=30.0, consumer_timeout=120.0)
    warning = consumer_timeout_warning(options, SETTLE)
    assert warning is not None
    for part in ("'orders'", "152 s", "concurrency=2", "deadline=30 s", "120 s", "consumer_timeout"):
        assert part in warning, (part, warning)


def test_a_configured_timeout_longer_than_the_backlog_says_nothing() -> None:
    options = QueueOptions(name="orders", concurrency=2, prefetch=8, deadline=30.0, consumer_timeout=152.0)
    assert consumer_timeout_warning(options, SETTLE) is None


def test_without_a_configured_timeout_only_a_delivery_s_own_run_is_held_against_the_default() -> None:
    # One permit behind 64 prefetched could wait an hour, but the broker's timeout is not known: no warning.
    assert consumer_timeout_warning(QueueOptions(name="orders", concurrency=1), SETTLE) is None
    warning = consumer_timeout_warning(QueueOptions(name="reports", deadline=1800.0), SETTLE)
    assert warning is not None
    for part in ("1817 s", "1800 s", "RabbitMQ's default"):
        assert part in warning, (part, warning)


@pytest.mark.parametrize(
    ("exists", "busy", "declares", "says"),
    [
        (False, True, True, "the queue was deleted; declaring it again"),
        (False, False, False, "the queue was deleted"),
        (True, True, True, "consumer timeout"),
        (None, True, False, "consumer timeout"),
        (True, False, True, "no reason given"),
    ],
)
def test_a_cancel_is_reported_with_its_likely_cause(exists: bool | None, busy: bool, declares: bool, says: str) -> None:
    cause = cancel_cause(exists=exists, busy=busy, declares=declares)
    assert says in cause, cause
    if exists is False and not declares:
        assert "declaring" not in cause


class OpenChannel:
    is_closed = False


def test_the_intake_is_not_ready_while_a_queue_has_no_consumer() -> None:
    intake = AmqpIntake(object(), confirm_timeout=10.0)  # type: ignore[arg-type]  # the connection is not used
    intake.handoff_channel = OpenChannel()  # type: ignore[assignment]
    consumers: list[Any] = []
    for index, name in enumerate(("orders", "payments")):
        consumer = intake.consumers[name] = QueueConsumer(QueueState(index, QueueOptions(name=name)))
        consumer.channel = OpenChannel()  # type: ignore[assignment]
        consumer.consumer_tag = f"ctag-{name}"
        consumers.append(consumer)
    assert intake.ready()
    consumers[1].consumer_tag = None  # the broker cancelled it; not consumed again yet
    assert not intake.ready()
