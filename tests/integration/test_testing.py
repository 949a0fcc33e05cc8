"""lily_mongo.testing: the real pipeline in-process against MongoDB, with no RabbitMQ in the loop.

Every consumer here points at a closed AMQP port: a test passing proves the broker was never needed.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pydantic
import pytest
from pymongo import AsyncMongoClient
from pymongo.errors import OperationFailure, PyMongoError

from lily_mongo import (
    ConfigError,
    Consumer,
    EventId,
    Json,
    MongoScope,
    QueueHandlerError,
    RetryCount,
    RetryPolicy,
    queue,
)
from lily_mongo.publisher import JSON, prepare_publication
from lily_mongo.testing import DeliveryResult, Faults, TestConsumer, check_idempotent
from tests.support.mongo import MongoDB

NO_BROKER = "amqp://guest:guest@127.0.0.1:1/"


class Order(pydantic.BaseModel):
    order_id: str
    total: int


def orders_consumer(mongodb: MongoDB, *handlers: Any) -> Consumer:
    consumer = Consumer(amqp_url=NO_BROKER, name="orders", mongo_client=mongodb.client, database=mongodb.name)
    consumer.configure_queue("orders", retry=RetryPolicy(max_retries=2, delays=(5.0, 60.0)))
    consumer.include(*handlers)
    return consumer


@pytest.fixture
async def tc(mongodb: MongoDB) -> AsyncIterator[TestConsumer]:
    """The orders consumer's plan running in-process (no broker) against the test's database."""
    async with TestConsumer(orders_consumer(mongodb, apply_order)) as running:
        yield running


@queue("orders", version=1, handler_id="orders.v1")
async def apply_order(order: Json[Order], event_id: EventId, retries: RetryCount, mongo: MongoScope) -> None:
    if order.total <= 0:
        raise QueueHandlerError.permanent("ORDER_INVALID", "total must be positive")
    if order.order_id.startswith("flaky") and retries == 0:
        raise QueueHandlerError.retryable("PAYMENT_DOWN", "gateway 503")
    await mongo.database["orders"].insert_one({"_id": order.order_id, "total": order.total}, session=mongo.session)
    await mongo.outbox.publish_json("orders.confirmed", {"order_id": order.order_id}, version=1)


async def test_a_valid_event_is_acked_applied_once_and_its_copy_is_a_duplicate(tc: TestConsumer) -> None:
    event = uuid.uuid4()
    first = await tc.publish_json("orders", {"order_id": "o1", "total": 5}, version=1, event_id=event)
    second = await tc.publish_json("orders", {"order_id": "o1", "total": 5}, version=1, event_id=event)
    assert (first.outcome, first.code, first.settlement) == ("acked", None, "ack")
    assert (second.outcome, second.settlement) == ("duplicate", "ack")
    assert await tc.database["orders"].find({}).to_list() == [{"_id": "o1", "total": 5}]
    # The outbox message was relayed (recorded), once, with the canonical envelope.
    [confirmed] = [m for m in tc.published if m.kind == "outbox"]
    assert confirmed.routing_key == "orders.confirmed"
    assert confirmed.headers["x-lily-schema-version"] == "1"
    assert confirmed.body == b'{"order_id":"o1"}'


async def test_outbox_messages_go_through_the_dispatch_after_commit_and_are_marked(tc: TestConsumer) -> None:
    # Recorded by the consumer's own dispatcher once the attempt committed, before publish_json returned;
    # the record is marked published, born claimed by that dispatcher (no relay claimed it).
    result = await tc.publish_json("orders", {"order_id": "o9", "total": 2}, version=1)
    assert result.outcome == "acked"
    [confirmed] = [m for m in tc.published if m.kind == "outbox"]
    [record] = await tc.database["lily_outbox"].find({}).to_list()
    assert record["event_id"] == confirmed.event_id
    assert (record["status"], record["attempts"], record["handler"]) == ("published", 0, "orders.v1")
    assert record["claim_owner"].startswith("orders:test:")
    assert await tc.relay_outbox() == 0  # nothing left for a relay


async def test_without_a_dispatcher_records_wait_for_relay_outbox(mongodb: MongoDB) -> None:
    async with TestConsumer(orders_consumer(mongodb, apply_order), relay_outbox=False) as tc:
        for n in range(3):
            assert (await tc.publish_json("orders", {"order_id": f"o{n}", "total": 1}, version=1)).outcome == "acked"
        assert [m for m in tc.published if m.kind == "outbox"] == []
        assert await tc.database["lily_outbox"].count_documents({"status": "pending", "claim_owner": None}) == 3
        assert await tc.relay_outbox() == 3
        outbox = [m for m in tc.published if m.kind == "outbox"]
        assert [json.loads(m.body)["order_id"] for m in outbox] == ["o0", "o1", "o2"]  # in commit order
        assert await tc.database["lily_outbox"].count_documents({"status": "published"}) == 3
        assert await tc.relay_outbox() == 0


async def test_a_permanent_failure_is_dead_lettered_with_its_code_and_the_copy_is_inspectable(tc: TestConsumer) -> None:
    event = uuid.uuid4()
    result = await tc.publish_json("orders", {"order_id": "o2", "total": 0}, version=1, event_id=event)
    assert (result.outcome, result.code) == ("dead_lettered", "ORDER_INVALID")
    [copy] = tc.published
    assert (copy.kind, copy.routing_key) == ("dlq", "orders.dlq")
    assert copy.headers["x-lily-failure-code"] == "ORDER_INVALID"
    assert copy.headers["x-lily-event-id"] == str(event)
    assert copy.headers["x-lily-failed-queue"] == "orders"
    assert await tc.database["orders"].count_documents({}) == 0


async def test_a_retryable_failure_makes_a_retry_copy_that_deliver_retries_runs_with_the_next_count(
    tc: TestConsumer,
) -> None:
    result = await tc.publish_json("orders", {"order_id": "flaky-1", "total": 3}, version=1)
    assert (result.outcome, result.code) == ("retried", "PAYMENT_DOWN")
    [copy] = tc.published
    assert (copy.kind, copy.routing_key, copy.headers["x-retry-count"]) == ("retry", "orders.retry.0", 1)
    [retried] = await tc.deliver_retries()
    assert retried.outcome == "acked"
    assert await tc.deliver_retries() == []  # each copy is delivered once
    assert await tc.database["orders"].count_documents({"_id": "flaky-1"}) == 1


async def test_contract_cases_go_through_the_same_checks(tc: TestConsumer) -> None:
    no_envelope = await tc.publish_raw("orders", headers={}, body=b"{}")
    assert (no_envelope.outcome, no_envelope.code) == ("dead_lettered", "QUEUE_ENVELOPE_INVALID")
    wrong_version = await tc.publish_json("orders", {"order_id": "x", "total": 1}, version=9)
    assert wrong_version.code == "QUEUE_SCHEMA_VERSION_UNSUPPORTED"
    bad_body = await tc.publish_json("orders", {"order_id": "x"}, version=1)
    assert bad_body.code == "QUEUE_PAYLOAD_INVALID"  # JSON that the model refuses
    broken = await tc.publish_raw(
        "orders", headers=prepare_publication(JSON, "orders", {}, version=1).headers, body=b'{"order_id": '
    )
    assert broken.code == "QUEUE_PAYLOAD_DECODE_FAILED"  # not JSON at all
    text = await tc.publish_text("orders", "hello", version=1)
    assert text.code == "QUEUE_CONTENT_KIND_UNSUPPORTED"


async def publish_under(mongodb: MongoDB, inject: str, order_id: str) -> tuple[DeliveryResult, int]:
    """One order delivered with the fault ``inject`` armed; its result and how many times it was applied."""
    async with TestConsumer(orders_consumer(mongodb, apply_order)) as tc:
        async with Faults(mongodb.client) as faults:
            await getattr(faults, inject)(1)
            result = await tc.publish_json("orders", {"order_id": order_id, "total": 1}, version=1)
        return result, await tc.database["orders"].count_documents({"_id": order_id})


async def test_an_injected_transient_error_replays(mongodb: MongoDB, failpoints: Faults) -> None:
    result, applied = await publish_under(mongodb, "transient_operations", "o3")
    assert result.outcome == "acked"
    assert (result.observation.attempts, result.observation.transient_replays) == (2, 1)
    assert applied == 1


async def test_an_injected_ambiguous_commit_is_reconciled(mongodb: MongoDB, failpoints: Faults) -> None:
    result, applied = await publish_under(mongodb, "ambiguous_commits", "o4")
    assert result.outcome == "acked"
    assert (result.observation.attempts, result.observation.reconciliations) == (1, 1)
    assert applied == 1


async def test_a_lease_held_elsewhere_defers_without_running_the_handler(tc: TestConsumer) -> None:
    event = uuid.uuid4()
    await tc.hold_lease("orders.v1", event, seconds=60)
    result = await tc.publish_json("orders", {"order_id": "o5", "total": 1}, version=1, event_id=event)
    assert (result.outcome, result.code, result.settlement) == ("deferred", "LEASE_HELD", "nack_requeue")
    assert len(tc.requeued) == 1
    assert await tc.database["orders"].count_documents({}) == 0


# -- Faults, the failpoint itself ---------------------------------------------------------------------
# Each test commands the server directly with PyMongo, so what it sees is the failpoint alone.


async def test_a_fault_fails_the_next_times_of_its_commands_with_its_code_labels_and_message(
    mongodb: MongoDB, failpoints: Faults
) -> None:
    orders = mongodb.db["orders"]
    await failpoints.fail("insert", code=112, labels=["TransientTransactionError"], times=2, message="injected")
    for n in range(2):
        with pytest.raises(OperationFailure) as failure:
            await orders.insert_one({"_id": n})
        assert failure.value.code == 112
        assert failure.value.has_error_label("TransientTransactionError")
        assert "injected" in str(failure.value)
    assert await orders.find_one({}) is None  # other commands are not failed
    await orders.insert_one({"_id": "third"})
    assert await orders.distinct("_id") == ["third"]


async def test_a_fault_without_times_stays_on_and_the_context_manager_clears_it_on_an_error(mongodb: MongoDB) -> None:
    orders = mongodb.db["orders"]
    refused: list[int] = []

    async def scenario() -> None:
        async with Faults(mongodb.client) as faults:
            await faults.fail(["insert"], code=8, times=None)
            for n in range(3):
                with pytest.raises(OperationFailure) as failure:
                    await orders.insert_one({"_id": n})
                refused.append(failure.value.code or 0)
            raise RuntimeError("the scenario failed")

    with pytest.raises(RuntimeError, match="the scenario failed"):
        await scenario()
    assert refused == [8, 8, 8]
    await orders.insert_one({"_id": "after"})
    assert await orders.distinct("_id") == ["after"]


async def test_a_fault_with_a_namespace_fails_that_collection_only(mongodb: MongoDB, failpoints: Faults) -> None:
    db = mongodb.db
    await failpoints.fail(["insert"], times=None, namespace=f"{mongodb.name}.records")
    await db["effects"].insert_one({"_id": 1})
    with pytest.raises(OperationFailure):
        await db["records"].insert_one({"_id": 1})
    assert (await db["effects"].count_documents({}), await db["records"].count_documents({})) == (1, 0)


async def test_a_fault_can_block_the_connection_before_it_fails(mongodb: MongoDB, failpoints: Faults) -> None:
    orders = mongodb.db["orders"]
    await failpoints.fail(["find"], block_ms=300)
    started = time.monotonic()
    with pytest.raises(OperationFailure):
        await orders.find_one({})
    assert time.monotonic() - started >= 0.25
    assert await orders.find_one({}) is None  # once only


async def test_a_fault_that_closes_the_connection_fails_the_command_once(mongodb: MongoDB, failpoints: Faults) -> None:
    # MongoDB drops the socket (PyMongo raises AutoReconnect); the emulator answers an error
    # reply instead (docs/emulator.md). Either way the command fails, and only that once.
    orders = mongodb.db["orders"]
    await failpoints.fail(["find"], close_connection=True)
    with pytest.raises(PyMongoError):
        await orders.find_one({})
    assert await orders.find_one({}) is None


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({"commands": []}, "commands must name at least one command, got none"),
        ({"commands": ["insert", ""]}, "commands must be command names, got str '' (length 0)"),
        ({"commands": ["insert"], "times": 0}, "times must be an integer 1..2147483647, got int 0"),
        ({"commands": ["insert"], "block_ms": -1}, "block_ms must be an integer 0..2147483647, got int -1"),
        ({"commands": ["insert"], "code": "112"}, "code must be an integer 0..2147483647, got str '112' (length 3)"),
        ({"commands": ["insert"], "close_connection": 1}, "close_connection must be True or False, got int 1"),
    ],
)
async def test_a_fault_refuses_arguments_the_server_could_not_take(
    mongodb: MongoDB, failpoints: Faults, arguments: dict[str, Any], says: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        await failpoints.fail(**arguments)
    assert str(refused.value) == says


# -- check_idempotent -------------------------------------------------------------------------------


async def ledger(database: Any) -> list[tuple[str, int]]:
    return sorted((doc["_id"], doc["total"]) for doc in await database["ledger"].find({}).to_list())


@queue("ledger", version=1, handler_id="ledger.v1")
async def correct_ledger(order: Json[Order], mongo: MongoScope) -> None:
    await mongo.database["ledger"].update_one(
        {"_id": "all"}, {"$inc": {"total": order.total}}, upsert=True, session=mongo.session
    )


@queue("ledger", version=1, handler_id="ledger.v1")
async def leaky_ledger(order: Json[Order], mongo: MongoScope) -> None:
    # The bug check_idempotent exists for: a write outside the attempt's session
    # survives the attempt's abort and is made again by the replay.
    await mongo.database["ledger"].update_one({"_id": "all"}, {"$inc": {"total": order.total}}, upsert=True)


def ledger_consumer(client: AsyncMongoClient[Any], handler: Any) -> Consumer:
    consumer = Consumer(amqp_url=NO_BROKER, name="ledger", mongo_client=client, database="unused")
    consumer.include(handler)
    return consumer


PAYLOADS = [{"order_id": f"o{n}", "total": n + 1} for n in range(3)]


async def test_check_idempotent_passes_a_correct_handler(mongodb: MongoDB, failpoints: Faults) -> None:
    await check_idempotent(ledger_consumer(mongodb.client, correct_ledger), "ledger", PAYLOADS, ledger)


async def fails_outside_the_session(mongodb: MongoDB, handler: Any, state: Any) -> str:
    """check_idempotent's failure for ``handler``, which must say it wrote outside its transaction."""
    with pytest.raises(AssertionError) as info:
        await check_idempotent(ledger_consumer(mongodb.client, handler), "ledger", PAYLOADS, state)
    message = str(info.value)
    assert message.startswith("check_idempotent: the handler wrote outside its attempt's transaction, into '")
    return message


async def test_check_idempotent_finds_a_handler_that_writes_outside_its_session(
    mongodb: MongoDB, failpoints: Faults
) -> None:
    # The command log shows the upsert outside any transaction in the clean run itself.
    message = await fails_outside_the_session(mongodb, leaky_ledger, ledger)
    assert ".ledger' (3 writes in a clean run)" in message, message
    assert "a write outside mongo.session? 'ledger' (upsert)" in message, message


@queue("ledger", version=1, handler_id="ledger.v1")
async def fixed_id_outside(order: Json[Order], mongo: MongoScope) -> None:
    await mongo.database["payments"].insert_one({"_id": order.order_id, "total": order.total})


@queue("ledger", version=1, handler_id="ledger.v1")
async def generated_id_outside(order: Json[Order], mongo: MongoScope) -> None:
    await mongo.database["payments"].insert_one({"order": order.order_id, "total": order.total})


@queue("ledger", version=1, handler_id="ledger.v1")
async def inc_outside(order: Json[Order], mongo: MongoScope) -> None:
    await mongo.database["payments"].insert_one({"_id": order.order_id, "n": 0}, session=mongo.session)
    await mongo.database["payments"].update_one({"_id": "tally"}, {"$inc": {"n": order.total}})


@queue("ledger", version=1, handler_id="ledger.v1")
async def upsert_outside(order: Json[Order], mongo: MongoScope) -> None:
    await mongo.database["payments"].update_one({"_id": order.order_id}, {"$set": {"n": order.total}}, upsert=True)


async def payments(database: Any) -> list[Any]:
    return sorted(str(doc.get("order", doc["_id"])) for doc in await database["payments"].find({}).to_list())


@pytest.mark.parametrize(
    ("handler", "shape"),
    [(fixed_id_outside, "insert"), (generated_id_outside, "insert"), (inc_outside, "$inc"), (upsert_outside, "upsert")],
    ids=["fixed _id", "generated _id", "$inc", "upsert"],
)
async def test_check_idempotent_fails_every_shape_of_write_outside_the_session_naming_the_collection(
    mongodb: MongoDB, failpoints: Faults, handler: Any, shape: str
) -> None:
    message = await fails_outside_the_session(mongodb, handler, payments)
    assert f"a write outside mongo.session? 'payments' ({shape}) written without session=mongo.session" in message


@queue("ledger", version=1, handler_id="ledger.v1")
async def never_succeeds(order: Json[Order], mongo: MongoScope) -> None:
    await mongo.database["payments"].insert_one({"_id": order.order_id}, session=mongo.session)
    raise RuntimeError("the gateway is down")


async def test_check_idempotent_fails_a_handler_that_never_succeeds_naming_the_outcome(
    mongodb: MongoDB, failpoints: Faults
) -> None:
    with pytest.raises(AssertionError) as info:
        await check_idempotent(ledger_consumer(mongodb.client, never_succeeds), "ledger", PAYLOADS, payments)
    message = str(info.value)
    assert message.startswith("check_idempotent: a clean delivery (no duplicate, no fault) of event "), message
    assert " ended dead_lettered (QUEUE_RETRIES_EXHAUSTED: " in message, message
    assert "last QUEUE_HANDLER_FAILED: RuntimeError: the gateway is down), not acked;" in message, message
    assert message.endswith("The handler raised RuntimeError: the gateway is down"), message


async def test_a_result_names_a_write_outside_the_session_behind_a_duplicate_key_error(mongodb: MongoDB) -> None:
    consumer = ledger_consumer(mongodb.client, fixed_id_outside)
    async with TestConsumer(consumer, database=mongodb.name) as tc:
        await mongodb.client[mongodb.name]["payments"].insert_one({"_id": "o1"})  # as an earlier attempt left it
        result = await tc.publish_json("ledger", {"order_id": "o1", "total": 1}, version=1)
    assert (result.outcome, result.code) == ("retried", "QUEUE_HANDLER_FAILED")
    assert type(result.exception).__name__ == "DuplicateKeyError"
    assert result.hint.startswith("a write outside mongo.session? 'payments' (insert) written without")
    assert ", hint=\"a write outside mongo.session? 'payments' (insert)" in repr(result)


async def test_a_handler_writing_in_its_session_gets_no_hint(mongodb: MongoDB) -> None:
    async with TestConsumer(ledger_consumer(mongodb.client, correct_ledger), database=mongodb.name) as tc:
        result = await tc.publish_json("ledger", {"order_id": "o1", "total": 1}, version=1)
    assert (result.outcome, result.hint, result.outside_session) == ("acked", "", ())
    assert tc.sessionless_writes == []


async def test_a_client_the_consumer_owns_is_closed_on_the_way_out_and_another_is_not(mongodb: MongoDB) -> None:
    owned: AsyncMongoClient[Any] = AsyncMongoClient(mongodb.uri)
    consumer = Consumer(
        amqp_url=NO_BROKER, name="owned", mongo_client=owned, owns_mongo_client=True, database=mongodb.name
    )
    consumer.include(correct_ledger)
    async with TestConsumer(consumer) as tc:
        assert (await tc.publish_json("ledger", {"order_id": "o1", "total": 1}, version=1)).outcome == "acked"
    with pytest.raises(PyMongoError):  # InvalidOperation: the client was closed
        await owned.admin.command("ping")
    async with TestConsumer(ledger_consumer(mongodb.client, correct_ledger), database=mongodb.name):
        pass
    assert (await mongodb.client.admin.command("ping"))["ok"] == 1.0  # the caller's client stays open
