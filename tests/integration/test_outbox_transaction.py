"""``Outbox.transaction(fn)``: the outbox for code outside handlers (docs/outbox.md, the standalone outbox).

``fn(tx)`` runs in a fresh session and transaction; its business writes and its
outbox records commit together. Faults come from the server's own failpoints
(``Faults``) and, for a commit that applies but whose reply is lost, from the
commit-cutting proxy of the inbox tests. Every test states what the database
holds afterwards: business documents, outbox records, and how often ``fn`` ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest

from lily_mongo import (
    CommitOutcomeUnknown,
    ConfigError,
    LilyError,
    Outbox,
    OutboxOptions,
    OutboxTransaction,
    ScopeClosedError,
)
from lily_mongo.envelope import validate_envelope
from lily_mongo.testing import Faults
from tests.support.broker import Broker
from tests.support.mongo import CommandLog, MongoDB, w1_client
from tests.support.proxy import CommitCutter, behind_a_cutter

OUTBOX = "lily_outbox"
ORDERS = "orders"
RETRY_ONCE = OutboxOptions(commit_retries=1)


def placing(
    down: str, calls: list[int], *, record: bool = True, order: str = "o1"
) -> Callable[[OutboxTransaction], Awaitable[str]]:
    """``fn``: stage an ``orders.placed`` message (first, so a failed run had staged one too), then insert the order."""

    async def place(tx: OutboxTransaction) -> str:
        calls.append(1)
        if record:
            await tx.publish_json(down, {"order_id": order}, version=1)
        await tx.database[ORDERS].insert_one({"_id": order}, session=tx.session)
        return "placed"

    return place


async def state(mongodb: MongoDB) -> tuple[int, list[dict[str, Any]]]:
    """Orders committed, and the outbox records."""
    return await mongodb.db[ORDERS].count_documents({}), await mongodb.db[OUTBOX].find({}).to_list()


async def counts(mongodb: MongoDB) -> tuple[int, int]:
    """Orders committed, and outbox records."""
    orders, records = await state(mongodb)
    return orders, len(records)


@contextlib.asynccontextmanager
async def outbox_behind_a_cutter(
    mongodb: MongoDB, *, cut_requests: int = 0, cut_replies: int = 0
) -> AsyncIterator[tuple[CommitCutter, Outbox]]:
    """An :class:`Outbox` (one commit retry) on the test's database behind a :class:`CommitCutter` that cuts
    that many commit requests or replies, and the cutter."""
    async with behind_a_cutter(mongodb) as (cutter, cut):
        outbox = Outbox(cut.client, cut.name, options=RETRY_ONCE)
        cutter.cut_requests, cutter.cut_replies = cut_requests, cut_replies
        yield cutter, outbox


# -- writes only (no amqp_url) ----------------------------------------------------------------------


async def test_a_transaction_commits_business_data_and_a_free_record_and_returns_fns_result(
    mongodb: MongoDB,
) -> None:
    outbox = Outbox(mongodb.client, mongodb.name, name="checkout")
    given = uuid.uuid4()

    async def place(tx: OutboxTransaction) -> tuple[uuid.UUID, uuid.UUID]:
        await tx.database[ORDERS].insert_one({"_id": "o1"}, session=tx.session)
        first = await tx.publish_json("orders.placed", {"order_id": "o1"}, version=1)
        second = await tx.publish_text("orders.audit", "o1 placed", version=2, event_id=given)
        return first, second

    first, second = await outbox.transaction(place)
    assert isinstance(first, uuid.UUID)
    assert second == given
    orders, records = await state(mongodb)
    assert orders == 1
    records.sort(key=lambda r: r["seq"])
    assert [(r["event_id"], r["routing_key"], r["seq"]) for r in records] == [
        (str(first), "orders.placed", 0),
        (str(given), "orders.audit", 1),
    ]
    for record in records:
        assert (record["status"], record["attempts"], record["handler"]) == ("pending", 0, "checkout")
        # Nothing dispatches without amqp_url: the record is free for a relay at once.
        assert "claim_owner" not in record
        assert "claim_expires" not in record
        validate_envelope(record["headers"], len(record["body"]))
    assert records[0]["available_at"] == records[1]["available_at"]  # one transaction, one time
    assert orjson.loads(records[0]["body"]) == {"order_id": "o1"}
    assert records[1]["headers"]["x-lily-content-kind"] == "text"


async def test_concurrent_publishes_of_one_transaction_take_distinct_positions_and_one_time(
    mongodb: MongoDB,
) -> None:
    outbox = Outbox(mongodb.client, mongodb.name)

    async def place(tx: OutboxTransaction) -> list[uuid.UUID]:
        return list(await asyncio.gather(*(tx.publish_json("orders.placed", {"n": n}, version=1) for n in range(3))))

    ids = await outbox.transaction(place)
    _, records = await state(mongodb)
    assert sorted(r["seq"] for r in records) == [0, 1, 2]
    assert {r["event_id"] for r in records} == {str(i) for i in ids}
    assert len({r["available_at"] for r in records}) == 1  # one transaction, one time


async def test_without_amqp_url_the_first_transaction_reads_the_servers_clock_once(mongodb: MongoDB) -> None:
    # Its records' times are corrected to the server's clock, as a relay's are: read on first use.
    listener = CommandLog()
    client = w1_client(mongodb, listener)
    try:
        outbox = Outbox(client, mongodb.name)
        assert not outbox.process.clock_read
        await outbox.transaction(placing("orders.placed", []))
        await outbox.transaction(placing("orders.placed", [], order="o2"))
    finally:
        await client.close()
    assert [e.command_name for e in listener.events].count("hello") == 1
    assert outbox.process.clock_read


async def test_an_exception_in_fn_aborts_everything_and_propagates(mongodb: MongoDB) -> None:
    outbox = Outbox(mongodb.client, mongodb.name)
    kept: list[OutboxTransaction] = []

    async def refuse(tx: OutboxTransaction) -> None:
        kept.append(tx)
        await tx.publish_json("orders.placed", {"order_id": "o1"}, version=1)
        await tx.database[ORDERS].insert_one({"_id": "o1"}, session=tx.session)
        raise ValueError("out of stock")

    with pytest.raises(ValueError, match="out of stock"):
        await outbox.transaction(refuse)
    assert await state(mongodb) == (0, [])
    [tx] = kept
    with pytest.raises(ScopeClosedError):
        _ = tx.session
    with pytest.raises(ScopeClosedError):
        await tx.publish_json("orders.placed", {}, version=1)


async def test_publish_is_validated_as_in_a_handler(mongodb: MongoDB) -> None:
    outbox = Outbox(mongodb.client, mongodb.name, options=OutboxOptions(max_body=16))

    async def too_big(tx: OutboxTransaction) -> None:
        await tx.publish_text("orders.placed", "x" * 16, version=1)  # at the bound: accepted
        await tx.publish_text("orders.placed", "x" * 17, version=1)

    with pytest.raises(ConfigError, match="QUEUE_BODY_TOO_LARGE"):
        await outbox.transaction(too_big)

    async def reserved(tx: OutboxTransaction) -> None:
        await tx.publish_json("orders.placed", {}, version=1, headers={"x-lily-event-id": "no"})

    with pytest.raises(ConfigError, match="reserved header"):
        await outbox.transaction(reserved)

    async def bad_version(tx: OutboxTransaction) -> None:
        await tx.publish_json("orders.placed", {}, version=0)

    with pytest.raises(ConfigError, match=r"1\.\.65535"):
        await outbox.transaction(bad_version)
    assert await state(mongodb) == (0, [])


async def test_an_outbox_with_amqp_url_must_be_opened_first(mongodb: MongoDB, broker: Broker) -> None:
    outbox = Outbox(mongodb.client, mongodb.name, amqp_url=broker.url)
    calls: list[int] = []
    with pytest.raises(LilyError, match="async with Outbox"):
        await outbox.transaction(placing("down", calls))
    assert calls == []
    await outbox.close()
    with pytest.raises(LilyError, match="closed"):
        await outbox.transaction(placing("down", calls))


# -- dispatch after commit (amqp_url) ---------------------------------------------------------------


async def test_with_amqp_url_the_records_are_published_right_after_the_commit(mongodb: MongoDB, broker: Broker) -> None:
    down = await broker.declare(broker.queue("down"))
    options = OutboxOptions(mark_interval=0.05)

    async def place(tx: OutboxTransaction) -> list[uuid.UUID]:
        await tx.database[ORDERS].insert_one({"_id": "o1"}, session=tx.session)
        return [await tx.publish_json(down, {"n": n}, version=1) for n in range(5)]

    async with Outbox(mongodb.client, mongodb.name, amqp_url=broker.url, options=options, name="web") as outbox:
        staged = await outbox.transaction(place)
        assert await broker.wait_for_depth(down, 5) == 5
    messages = await broker.drain(down)
    assert [m.headers["x-lily-event-id"] for m in messages] == [str(e) for e in staged]  # in write order
    for n, message in enumerate(messages):
        assert orjson.loads(message.body) == {"n": n}
        assert message.headers["x-lily-schema-version"] == "1"
        assert message.content_type == "application/json"
        validate_envelope(message.headers, len(message.body))
    _, records = await state(mongodb)
    assert {r["status"] for r in records} == {"published"}  # marked before close() returned
    # Born claimed by this outbox's own dispatcher, never by a relay.
    assert {(r["claim_owner"].split(":")[0], r["claim_token"]) for r in records} == {
        ("web", outbox.process.dispatcher.token)
    }


# -- faults: re-runs and reconciliation ---------------------------------------------------------------


async def test_a_transient_error_in_fn_reruns_it_with_one_business_write_and_one_record(
    mongodb: MongoDB, failpoints: Faults
) -> None:
    outbox = Outbox(mongodb.client, mongodb.name)
    calls: list[int] = []
    await failpoints.fail(
        ["insert"], code=112, labels=["TransientTransactionError"], namespace=f"{mongodb.name}.{ORDERS}"
    )
    assert await outbox.transaction(placing("orders.placed", calls)) == "placed"
    assert len(calls) == 2  # the failed run had staged its record too: aborted with it
    assert await counts(mongodb) == (1, 1)


async def test_a_transient_commit_failure_reruns_fn(mongodb: MongoDB, failpoints: Faults) -> None:
    outbox = Outbox(mongodb.client, mongodb.name)
    calls: list[int] = []
    await failpoints.transient_commits(1)
    assert await outbox.transaction(placing("orders.placed", calls)) == "placed"
    assert len(calls) == 2
    assert await counts(mongodb) == (1, 1)


async def test_transient_errors_beyond_the_retries_give_up_with_nothing_committed(
    mongodb: MongoDB, failpoints: Faults
) -> None:
    outbox = Outbox(mongodb.client, mongodb.name, options=OutboxOptions(transaction_retries=2))
    calls: list[int] = []
    await failpoints.transient_commits(times=10)
    with pytest.raises(LilyError, match="did not commit after 3 runs"):
        await outbox.transaction(placing("orders.placed", calls))
    assert len(calls) == 3
    assert await state(mongodb) == (0, [])


async def test_an_unknown_commit_result_is_retried_without_running_fn_again(
    mongodb: MongoDB, failpoints: Faults
) -> None:
    outbox = Outbox(mongodb.client, mongodb.name)
    calls: list[int] = []
    await failpoints.ambiguous_commits(1)  # the retry of the same commit commits
    assert await outbox.transaction(placing("orders.placed", calls)) == "placed"
    assert calls == [1]
    assert await counts(mongodb) == (1, 1)


async def test_a_lost_commit_reply_is_reconciled_from_the_transactions_own_record(mongodb: MongoDB) -> None:
    # The commit applies but its reply is lost, twice (the commit and its one retry): the record
    # read back with majority read concern proves the commit; fn is not run again.
    calls: list[int] = []
    async with outbox_behind_a_cutter(mongodb, cut_replies=2) as (cutter, outbox):
        assert await outbox.transaction(placing("orders.placed", calls)) == "placed"
        assert cutter.cuts == 2
    assert calls == [1]
    assert await counts(mongodb) == (1, 1)


async def test_a_commit_that_never_reached_the_server_is_reported_unknown_not_rerun(mongodb: MongoDB) -> None:
    calls: list[int] = []
    async with outbox_behind_a_cutter(mongodb, cut_requests=2) as (_, outbox):
        with pytest.raises(CommitOutcomeUnknown, match="outbox record is not visible"):
            await outbox.transaction(placing("orders.placed", calls))
    assert calls == [1]
    assert await state(mongodb) == (0, [])


async def test_without_an_outbox_record_only_the_commit_retries_can_decide(mongodb: MongoDB) -> None:
    # Nothing to read back: a lost reply stays unknown even though the commit applied.
    calls: list[int] = []
    async with outbox_behind_a_cutter(mongodb, cut_replies=2) as (_, outbox):
        with pytest.raises(CommitOutcomeUnknown, match="wrote no outbox record"):
            await outbox.transaction(placing("orders.placed", calls, record=False))
    assert calls == [1]
    assert await state(mongodb) == (1, [])


# -- write and read concerns ----------------------------------------------------------------------------


async def test_every_write_outside_the_transaction_is_majority_and_the_read_back_majority(
    mongodb: MongoDB, broker: Broker, failpoints: Faults
) -> None:
    # A client whose own default is w=1: the outbox still asks for a majority.
    listener = CommandLog()
    client = w1_client(mongodb, listener)
    down = broker.queue("nowhere")  # undeclared: the dispatch fails and records its failure
    try:
        async with Outbox(client, mongodb.name, amqp_url=broker.url, options=OutboxOptions(mark_interval=0)) as outbox:
            await outbox.transaction(placing(down, []))
            await outbox.process.dispatched()
            await failpoints.fail(["commitTransaction"], code=50, labels=["UnknownTransactionCommitResult"], times=4)
            with pytest.raises(CommitOutcomeUnknown):
                await outbox.transaction(placing(down, [], order="o2"))
    finally:
        await client.close()
    on_outbox = listener.naming(OUTBOX)
    outside = [e for e in on_outbox if "txnNumber" not in e.command]
    writes = [e for e in outside if e.command_name in ("insert", "update", "delete", "findAndModify")]
    assert writes, "the failed dispatch wrote its failure"
    assert {e.command_name for e in writes} == {"update"}
    assert all(e.command.get("writeConcern") == {"w": "majority"} for e in writes), [e.command for e in writes]
    # The read-back names the record's _id (a relay's finds name a range or an $in list).
    [read_back] = [e for e in outside if e.command_name == "find" and isinstance(e.command["filter"].get("_id"), str)]
    assert read_back.command.get("readConcern") == {"level": "majority"}
    # The transaction's own insert carries no write concern of its own (the commit does).
    inserts = [e for e in on_outbox if e.command_name == "insert"]
    assert inserts
    assert all("txnNumber" in e.command for e in inserts)


async def test_a_record_too_large_for_the_relay_s_claim_is_refused_naming_its_size(mongodb: MongoDB) -> None:
    """A record that fits MongoDB's 16 MiB only without the claim's and the marks' fields would fail its
    whole batch's claim later: refused at the write, the transaction not committed."""
    outbox = Outbox(mongodb.client, mongodb.name, options=OutboxOptions(max_body=16 * 1024 * 1024))
    body = b"x" * (16 * 1024 * 1024 - 2 * 1024)  # under the body bound, over the record bound

    async def place(tx: OutboxTransaction) -> None:
        await tx.database[ORDERS].insert_one({"_id": "big"}, session=tx.session)
        await tx.publish_binary("orders.placed", body, version=1)

    with pytest.raises(ConfigError) as refused:
        await outbox.transaction(place)
    assert str(refused.value).startswith("an outbox record of ")
    assert f"(body {len(body)} bytes) exceeds {16 * 1024 * 1024 - 4 * 1024} bytes" in str(refused.value)
    assert await counts(mongodb) == (0, 0)
