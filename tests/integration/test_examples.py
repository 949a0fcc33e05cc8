"""The README's example service and the demo's handler, tested with lily_mongo.testing (no RabbitMQ)."""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pymongo import AsyncMongoClient

from lily_mongo._cli import demo
from lily_mongo.testing import Faults, TestConsumer, check_idempotent

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_service(client: AsyncMongoClient[Any]) -> dict[str, Any]:
    """Run the README's "A service in 20-odd lines" block as written, with the test's MongoDB client."""
    text = README.read_text()
    block = text.split("## A service in 20", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    block, replaced = re.subn(r'AsyncMongoClient\("[^"]*"\)', "_test_client", block)
    assert replaced == 1, "the README example builds its client differently now: update this test"
    namespace: dict[str, Any] = {"_test_client": client}
    exec(compile(block, str(README), "exec"), namespace)
    return namespace


async def test_the_readme_service_applies_an_order_once_and_dead_letters_an_invalid_one(
    mongo_client: AsyncMongoClient[Any], database_name: str
) -> None:
    service = readme_service(mongo_client)
    async with TestConsumer(service["consumer"], database=database_name) as tc:
        event = uuid.uuid4()
        order = {"order_id": "o1", "total_cents": 500}
        assert (await tc.publish_json("orders.created", order, version=1, event_id=event)).outcome == "acked"
        assert (await tc.publish_json("orders.created", order, version=1, event_id=event)).outcome == "duplicate"
        invalid = await tc.publish_json("orders.created", {"order_id": "o2", "total_cents": 0}, version=1)
        assert (invalid.outcome, invalid.code) == ("dead_lettered", "ORDER_INVALID")
        assert await tc.database["orders"].find({}).to_list() == [{"_id": "o1", "total": 500}]
        assert [(m.kind, m.routing_key) for m in tc.published] == [
            ("outbox", "orders.confirmed"),
            ("dlq", "orders.created.dlq"),
        ]


# -- the demo's handler is idempotent ---------------------------------------------------------------

lines = st.lists(
    st.fixed_dictionaries(
        {"sku": st.sampled_from(["a", "b", "c"]), "quantity": st.integers(1, 5), "unit_cents": st.integers(0, 900)}
    ),
    min_size=0,  # an order without lines is dead-lettered (ORDER_INVALID): no effect either way
    max_size=3,
)
orders = st.builds(
    lambda lines, customer, flaky: {
        "order_id": str(uuid.uuid4()),
        "customer": customer,
        "lines": lines,
        "flaky_payment": flaky,  # fails once with a retryable error, then succeeds on the retry copy
    },
    lines,
    st.sampled_from(["ada", "bob"]),
    st.booleans(),
)


async def ledger(database: Any) -> tuple[list[Any], list[Any]]:
    placed = sorted((o["_id"], o["customer"], o["total_cents"]) for o in await database["orders"].find({}).to_list())
    balances = sorted((b["_id"], b["total_cents"], b["orders"]) for b in await database["balances"].find({}).to_list())
    return placed, balances


@settings(max_examples=4, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payloads=st.lists(orders, min_size=1, max_size=3))
async def test_the_demo_handler_is_idempotent_under_duplicates_and_faults(
    mongo_client: AsyncMongoClient[Any], failpoints: Faults, payloads: list[dict[str, Any]]
) -> None:
    consumer = demo.build_consumer("amqp://guest:guest@127.0.0.1:1/", mongo_client, "unused", "orders", "confirmed")
    await check_idempotent(consumer, "orders", payloads, ledger)
