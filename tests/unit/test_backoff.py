"""The one backoff rule and the three waits built on it, against the bounds the docs state.

docs/inbox.md: replays and commit retries wait ``backoff_base * 2^n`` capped by
``backoff_max``, at least half the step. docs/settlement.md, section 4: the pause
before a requeue is ``min(0.05 s * 2^min(n, 6), 2 s)`` times a factor between 0.5
and 1, never over the queue's ``cooperation_window``. docs/outbox.md: an outbox
record's next attempt waits an exponential backoff from ``backoff_base`` capped
at ``backoff_max``.
"""

from __future__ import annotations

import asyncio
import datetime
import random
from types import SimpleNamespace
from typing import Any

import aiormq.base
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lily_mongo._backoff import backoff
from lily_mongo._engine import effects as effects_module
from lily_mongo._engine.settlement import Budget, Evidence, HandoffState
from lily_mongo._errors import PublishError
from lily_mongo._outbox import OutboxCounters, OutboxOptions, protocol
from lily_mongo._outbox.publishing import ExchangeMissing
from lily_mongo._verdicts import Execution, Outcome, PipelineResult

FAST = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize(
    ("retry", "base", "cap", "jitter", "low", "high"),
    [
        (1, 0.02, 1.0, 0.0, 0.02, 0.02),  # step 0.04: half of it without jitter
        (1, 0.02, 1.0, 0.5, 0.03, 0.03),
        (3, 0.02, 1.0, 0.0, 0.08, 0.08),  # step 0.16
        (3, 0.02, 1.0, 0.999, 0.159, 0.16),
        (10, 0.02, 1.0, 0.0, 0.5, 0.5),  # 20.48 capped at 1.0
        (10, 0.02, 1.0, 0.999, 0.999, 1.0),
        (100, 1.0, 600.0, 0.25, 375.0, 375.0),  # capped at 600
        (10_000, 0.05, 2.0, 0.0, 1.0, 1.0),  # a deferral count far past any doubling: the cap
    ],
)
def test_backoff_examples(retry: int, base: float, cap: float, jitter: float, low: float, high: float) -> None:
    assert low - 1e-9 <= backoff(retry, base=base, cap=cap, jitter=jitter) <= high + 1e-9


@FAST
@given(
    retry=st.integers(0, 100),
    base=st.floats(0.001, 60.0),
    cap_over_base=st.floats(1.0, 1000.0),
    jitter=st.floats(0.0, 1.0, exclude_max=True),
)
def test_backoff_is_at_least_half_the_capped_step_and_at_most_the_step(
    retry: int, base: float, cap_over_base: float, jitter: float
) -> None:
    cap = base * cap_over_base
    step = min(cap, base * 2**retry)
    delay = backoff(retry, base=base, cap=cap, jitter=jitter)
    assert step / 2 * (1 - 1e-9) <= delay <= step * (1 + 1e-9)
    assert delay <= cap * (1 + 1e-9)
    # Never shorter than the previous retry's delay with the same jitter.
    if retry > 0:
        assert backoff(retry - 1, base=base, cap=cap, jitter=jitter) <= delay * (1 + 1e-9)


# -- the pause before a requeue -------------------------------------------------------------------


def pause(monkeypatch: pytest.MonkeyPatch, budget: Budget, evidence: Evidence, **options: Any) -> float:
    """The seconds a delivery's settlement effects sleep before a requeue."""
    slept: list[float] = []

    async def sleep(delay: float) -> None:
        slept.append(delay)

    monkeypatch.setattr("lily_mongo._engine.effects.asyncio.sleep", sleep)
    execution = Execution(PipelineResult(Outcome.DEFERRED), backoff_limit=options.pop("backoff_limit", None))
    queue_options = SimpleNamespace(cooperation_window=options.pop("cooperation_window", 5.0))
    delivery = SimpleNamespace(execution=execution, qs=SimpleNamespace(options=queue_options), barrier=None)
    effects = effects_module.DeliveryEffects(None, delivery)  # type: ignore[arg-type]
    asyncio.run(effects.pause_before_requeue(budget, evidence))
    (delay,) = slept
    return delay


@pytest.mark.parametrize("count", [0, 1, 3, 6, 7, 20, 10_000])
def test_the_requeue_pause_stays_within_its_documented_bounds(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    step = min(0.05 * 2 ** min(count, 6), 2.0)
    for _ in range(50):
        delay = pause(monkeypatch, Budget(deferrals=count), Evidence())
        assert step * 0.5 <= delay <= step
    # After handoff failures the count is the failures so far, not the deferrals.
    failed = Evidence(handoff=HandoffState.FAILED)
    assert pause(monkeypatch, Budget(deferrals=0, handoff_failures=count), failed) >= step * 0.5


def test_the_requeue_pause_is_cut_to_the_lease_and_to_the_cooperation_window(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pause(monkeypatch, Budget(deferrals=20), Evidence(), backoff_limit=0.3) == pytest.approx(0.3)
    assert pause(monkeypatch, Budget(deferrals=20), Evidence(), backoff_limit=-1.0) == 0.0
    assert pause(monkeypatch, Budget(deferrals=20), Evidence(), cooperation_window=0.1) == pytest.approx(0.1)


# -- an outbox record's next attempt ----------------------------------------------------------------


@pytest.mark.parametrize("attempts", [0, 1, 4, 30])
def test_an_outbox_record_waits_the_capped_exponential_step_before_its_next_attempt(attempts: int) -> None:
    options = OutboxOptions(backoff_base=0.5, backoff_max=60.0, max_attempts=1000)
    counters = OutboxCounters(options)
    record = {"_id": "r", "claim_token": "t", "exchange": "", "routing_key": "q", "attempts": attempts}
    step = min(0.5 * 2**attempts, 60.0)  # the record's attempts so far, before this one failed
    for _ in range(20):
        now = datetime.datetime.now(datetime.UTC)
        failure = counters.failure(
            record, PublishError("unroutable", "returned"), jitter=random.random(), alone=True, release_delay=0.0
        )
        update = protocol.failure_update(failure, now)["$set"]
        assert update["attempts"] == attempts + 1
        assert update["status"] == "pending"
        assert update["last_error"] == "publish unroutable"
        assert now + datetime.timedelta(seconds=step / 2) <= update["available_at"]
        assert update["available_at"] <= now + datetime.timedelta(seconds=step)


def test_an_outbox_record_is_parked_as_failed_at_its_last_attempt() -> None:
    counters = OutboxCounters(OutboxOptions(max_attempts=3))
    refused = PublishError("unroutable", "nowhere")
    assert counters.failure({"attempts": 1}, refused, jitter=0.5, alone=False, release_delay=1.0).parked is False
    parked = counters.failure({"attempts": 2}, refused, jitter=0.5, alone=False, release_delay=1.0)
    assert (parked.attempts, parked.parked) == (3, True)
    assert protocol.failure_update(parked, datetime.datetime.now(datetime.UTC))["$set"]["status"] == "failed"
    assert counters.unroutable == 2


@pytest.mark.parametrize(
    "exc",
    [
        PublishError("timeout", "no confirm"),
        PublishError("nacked", "a resource alarm"),
        PublishError("closed", "the connection closed"),
        TimeoutError(),
        ConnectionResetError(),
    ],
    ids=["timeout", "nacked", "closed", "confirm-timeout", "reset"],
)
def test_a_transport_failure_releases_the_record_without_counting_an_attempt(exc: BaseException) -> None:
    counters = OutboxCounters(OutboxOptions(max_attempts=1))
    failure = counters.failure({"attempts": 0}, exc, jitter=0.5, alone=True, release_delay=2.0)
    assert (failure.attempts, failure.parked, failure.counted, failure.delay) == (0, False, False, 2.0)
    update = protocol.failure_update(failure, datetime.datetime.now(datetime.UTC))
    assert "attempts" not in update["$set"]
    assert update["$set"]["status"] == "pending"
    assert counters.released == 1


async def test_a_publish_waiting_on_a_channel_closed_without_a_reason_is_released_not_counted() -> None:
    # aio-pika's close() closes aiormq's channel with no exception: aiormq fails each future still
    # waiting on it (a publish's confirm) with a plain Exception.
    store = aiormq.base.FutureStore(asyncio.get_running_loop())
    confirm = store.create_future()
    await store.reject_all(None)
    exc = confirm.exception()
    assert exc is not None
    counters = OutboxCounters(OutboxOptions(max_attempts=1))
    failure = counters.failure({"attempts": 0}, exc, jitter=0.5, alone=True, release_delay=2.0)
    assert (failure.attempts, failure.parked, failure.counted) == (0, False, False)
    assert counters.released == 1


def test_a_malformed_record_and_a_missing_exchange_are_the_records_own_faults() -> None:
    counters = OutboxCounters(OutboxOptions(max_attempts=1))
    for exc in (KeyError("routing_key"), ExchangeMissing("gone"), PublishError("invalid", "a bad header")):
        failure = counters.failure({"attempts": 0}, exc, jitter=0.5, alone=False, release_delay=2.0)
        assert (failure.attempts, failure.parked, failure.counted) == (1, True, True)
