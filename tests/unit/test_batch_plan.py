"""Batch handlers' pure parts: BatchOptions' bounds, the plan's rules, the claim's reading of records, the barrier
that holds a batch's ACKs (docs/handlers.md, "Batch handlers"; docs/configuration.md, "BatchOptions")."""

from __future__ import annotations

import asyncio
import datetime
import uuid
from typing import Any

import pydantic
import pytest

from lily_mongo import (
    Batch,
    BatchEntry,
    BatchOptions,
    ConfigError,
    Consumer,
    EventId,
    Json,
    PlanError,
    Text,
    queue,
)
from lily_mongo._engine.barrier import SettleBarrier
from lily_mongo._inbox import batch_claim, first_claim
from lily_mongo._inbox.first_claim import FirstClaim

URL = "amqp://guest:guest@127.0.0.1:1/"


class Reading(pydantic.BaseModel):
    n: int


def plan_of(*handlers: Any, **queue_options: Any) -> Any:
    consumer = Consumer(amqp_url=URL, name="plan")
    if queue_options:
        consumer.configure_queue("readings", **queue_options)
    consumer.include(*handlers)
    return consumer.plan()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_size": 0}, "BatchOptions.max_size"),
        ({"max_size": 4097}, "BatchOptions.max_size"),
        ({"max_wait": 0}, "BatchOptions.max_wait"),
        ({"max_wait": 61}, "BatchOptions.max_wait"),
        ({"max_size": "10"}, "BatchOptions.max_size"),
    ],
)
def test_batch_options_name_the_field_the_value_and_the_bound(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        BatchOptions(**options)


def test_a_queue_whose_prefetch_cannot_fill_a_batch_is_refused_naming_both() -> None:
    @queue("readings", version=1, batch=BatchOptions(max_size=100))
    async def ingest(items: Batch[Json[Reading]]) -> None: ...

    with pytest.raises(PlanError) as error:
        plan_of(ingest, prefetch=50, concurrency=2)
    text = str(error.value)
    assert "max_size 100" in text
    assert "prefetch is 50" in text
    assert "prefetch=300" in text  # (concurrency + 1) * max_size
    plan = plan_of(ingest, prefetch=100, concurrency=2)
    assert plan.handlers[0].batch == BatchOptions(max_size=100)


def test_an_unconfigured_batch_queue_gets_room_for_two_batches() -> None:
    @queue("readings", version=1, batch=BatchOptions(max_size=300))
    async def ingest(items: Batch[Text]) -> None: ...

    assert plan_of(ingest).queues["readings"].prefetch == 600


def test_a_batch_handler_refuses_parameters_that_read_one_delivery() -> None:
    @queue("readings", version=1, batch=BatchOptions(max_size=10))
    async def ingest(items: Batch[Json[Reading]], event_id: EventId) -> None: ...

    with pytest.raises(PlanError, match="parameter 'event_id' reads one delivery"):
        plan_of(ingest)


def test_batch_options_and_a_batch_parameter_go_together() -> None:
    @queue("readings", version=1, batch=BatchOptions(max_size=10))
    async def no_batch(reading: Json[Reading]) -> None: ...

    @queue("readings", version=1)
    async def no_options(items: Batch[Json[Reading]]) -> None: ...

    @queue("readings", version=1, batch=BatchOptions(max_size=10))
    async def no_body(items: Batch[int]) -> None: ...

    with pytest.raises(PlanError, match="needs a body parameter Batch"):
        plan_of(no_batch)
    with pytest.raises(PlanError, match="needs @queue"):
        plan_of(no_options)
    with pytest.raises(PlanError, match="needs a body extractor"):
        plan_of(no_body)
    with pytest.raises(ConfigError, match="batch must be a BatchOptions"):
        queue("readings", version=1, batch={"max_size": 3})  # type: ignore[arg-type]


def test_the_batch_claim_reads_records_as_the_protocol_does() -> None:
    # The snapshot read's records, read as a first-time copy's claim reads what it found.
    assert first_claim.read_first_claim(None) is FirstClaim.CLAIMED
    assert first_claim.read_first_claim({"_id": "k", "state": "completed"}) is FirstClaim.DUPLICATE
    assert first_claim.read_first_claim({"_id": "k", "state": "leased", "owner": "o"}) is FirstClaim.CONTENDED
    assert first_claim.read_first_claim({"_id": "k", "deferrals": 3}) is FirstClaim.CONTENDED  # a counting record
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    [record] = batch_claim.batch_records("h", [("h|e", "e")], "owner:1", now=now, retention_seconds=60)
    single = first_claim.first_claim_transition(
        None, key="h|e", handler_id="h", event_id="e", owner="owner:1", now=now, retention_seconds=60
    )
    assert record == single  # the same record a first-time copy's claim writes
    assert (record["state"], record["token"], record["purge_at"]) == (
        "completed",
        1,
        now + datetime.timedelta(seconds=60),
    )


async def test_a_batchs_acks_wait_until_every_member_reached_its_write() -> None:
    barrier = SettleBarrier(3, bound=5.0)
    order: list[str] = []
    members = [object(), object(), object()]

    async def ack(i: int) -> None:
        await barrier.ready_to_ack(members[i])
        order.append(f"ack {i}")

    first = asyncio.ensure_future(ack(0))
    second = asyncio.ensure_future(ack(1))
    await asyncio.sleep(0.01)
    assert order == []  # the third member is still publishing its DLQ copy
    barrier.arrive(members[2])
    barrier.arrive(members[2])  # idempotent
    await asyncio.gather(first, second)
    assert sorted(order) == ["ack 0", "ack 1"]


async def test_a_member_that_never_arrives_holds_the_acks_only_for_the_bound() -> None:
    barrier = SettleBarrier(2, bound=0.05)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await barrier.ready_to_ack(object())
    assert 0.04 <= loop.time() - started < 1.0


def test_a_batch_is_a_read_only_sequence_whose_entries_fail_alone() -> None:
    delivery: Any = object()
    entries = [BatchEntry(uuid.uuid4(), 0, n, delivery) for n in range(3)]
    batch = Batch(entries)
    assert (len(batch), batch[1] is entries[1], batch.bodies) == (3, True, [0, 1, 2])
    batch.fail(entries[1], ValueError("bad"))
    assert isinstance(batch.failure_of(entries[1]), ValueError)
    assert batch.failure_of(entries[0]) is None
    with pytest.raises(ValueError, match="not an entry of this batch"):
        batch.fail(BatchEntry(entries[0].event_id, 0, 0, delivery), ValueError("x"))
