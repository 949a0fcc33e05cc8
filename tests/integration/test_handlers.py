"""Writing handlers (docs/handlers.md): failures you can see, dependencies, the lifespan, MongoDatabase.

Against the real RabbitMQ (``lily-mongo run`` in a subprocess, a started consumer) and
the test's MongoDB (``TestConsumer``, ``check_idempotent``). Expected logs, orders and
states are written out here.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import textwrap
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Annotated, Any

import pytest
from pymongo.errors import PyMongoError

from lily_mongo import (
    Consumer,
    Depends,
    EventId,
    Json,
    MongoDatabase,
    MongoScope,
    Resource,
    RetryPolicy,
    queue,
)
from lily_mongo.testing import Faults, TestConsumer, check_idempotent
from tests.support.broker import Broker
from tests.support.cli import cli_env, cli_process, wait_for_consumers
from tests.support.mongo import MongoDB
from tests.support.polling import eventually
from tests.support.resources import Events, per_attempt

NO_BROKER = "amqp://guest:guest@127.0.0.1:1/"
BURST = 200
HANDFUL = 5  # tracebacks a burst may show: one per 10 s window, and the burst takes seconds


# -- failures you can see: `lily-mongo run` at its default log level ---------------------------------


def write_failing_service(directory: Path, q: str, token: str) -> None:
    """``failing.consumer``: every delivery of ``q`` raises; its lifespan writes ``lifespan.log``."""
    source = f"""
        from __future__ import annotations

        import contextlib
        import os
        import pathlib
        from typing import Annotated

        from lily_mongo import Consumer, Json, Resource, RetryPolicy, queue

        LOG = pathlib.Path(__file__).with_name("lifespan.log")


        @contextlib.asynccontextmanager
        async def lifespan(consumer):
            LOG.write_text("enter\\n")
            try:
                yield {{"token": {token!r}}}
            finally:
                with LOG.open("a") as log:
                    log.write("exit\\n")


        @queue({q!r}, version=1, guarantee="at_least_once")
        async def explode(payload: Json[dict[str, object]], token: Annotated[str, Resource("token")]) -> None:
            raise RuntimeError(f"unexpected bug {{token}}")


        consumer = Consumer(amqp_url=os.environ["LILY_AMQP_URL"], name="failing", lifespan=lifespan)
        consumer.configure_queue({q!r}, concurrency=4, prefetch=32, retry=RetryPolicy(max_retries=0, delays=()))
        consumer.include(explode)
    """
    (directory / "failing.py").write_text(textwrap.dedent(source))


async def test_run_honours_the_lifespan_shows_the_handlers_traceback_and_counts_a_burst(
    amqp: str, mongo_uri: str, broker: Broker, tmp_path: Path
) -> None:
    q, token = broker.queue("bug"), uuid.uuid4().hex
    write_failing_service(tmp_path, q, token)
    async with cli_process("run", "failing:consumer", env=cli_env(amqp, mongo_uri), cwd=tmp_path) as process:
        await wait_for_consumers(broker.connection, q, process)
        first = await broker.publish(q, {"n": 0})
        await broker.wait_for_depth(f"{q}.dlq", 1)
        await broker.publish_all(q, [{"n": n} for n in range(1, BURST + 1)])
        await broker.wait_for_depth(f"{q}.dlq", BURST + 1, timeout=60)
        result = await process.stop(timeout=30)
    assert result.returncode == 0, result.describe()
    # The command honours the lifespan: entered (its resource reached the handler), exited at shutdown.
    assert (tmp_path / "lifespan.log").read_text().splitlines() == ["enter", "exit"]
    assert "lifespan_exit" in result.stdout, result.describe()
    lines = result.stderr.splitlines()
    failed = [n for n, line in enumerate(lines) if "handler failed: RuntimeError: unexpected bug " + token in line]
    dead = [n for n, line in enumerate(lines) if "delivery dead_lettered" in line]
    assert failed, result.describe()
    # The first failure: its line names where, then its traceback with the message, before the dead letter.
    assert f"event_id={first} attempt=1" in lines[failed[0]], lines[failed[0]]
    assert f"queue={q} handler={q}/v1/json/explode" in lines[failed[0]]
    assert lines[failed[0] + 1] == "Traceback (most recent call last):"
    raised_at = next(n for n in range(failed[0], len(lines)) if lines[n] == f"RuntimeError: unexpected bug {token}")
    assert raised_at < dead[0], result.describe()
    # The burst: a handful of tracebacks; every other failure counted, none lost.
    tracebacks = result.stderr.count("Traceback (most recent call last):")
    assert 1 <= tracebacks <= HANDFUL, result.describe()
    counted = sum(
        int(n) for n in re.findall(r"(\d+) more failures (?:of this handler )?since its last traceback", result.stderr)
    )
    assert tracebacks + counted == BURST + 1, result.describe()


# -- dependencies per attempt, with the inbox --------------------------------------------------------


@queue("notes", version=1, handler_id="notes.v1")
async def save_note(
    note: Json[dict[str, Any]], tenant: Annotated[str, Depends(per_attempt)], mongo: MongoScope
) -> None:
    await mongo.database["notes"].insert_one({"tenant": tenant, "text": note["text"]}, session=mongo.session)
    if note.get("fail"):
        raise RuntimeError("after the write")


def recording(events: list[str], **resources: Any) -> Any:
    @contextlib.asynccontextmanager
    async def lifespan(consumer: Consumer) -> AsyncIterator[Mapping[str, Any]]:
        events.append("lifespan enter")
        try:
            yield {"events": events, **resources}
        finally:
            events.append("lifespan exit")

    return lifespan


def notes_consumer(mongodb: MongoDB, events: list[str]) -> Consumer:
    consumer = Consumer(
        amqp_url=NO_BROKER, name="notes", mongo_client=mongodb.client, database=mongodb.name, lifespan=recording(events)
    )
    consumer.configure_queue("notes", retry=RetryPolicy(max_retries=0, delays=()))
    consumer.include(save_note)
    return consumer


async def test_a_generator_factory_is_cleaned_up_once_per_attempt_including_a_transient_replay(
    mongodb: MongoDB, failpoints: Faults
) -> None:
    events: list[str] = []
    async with TestConsumer(notes_consumer(mongodb, events)) as tc:
        await failpoints.transient_operations(1, commands=("insert",))
        replayed = await tc.publish_json("notes", {"text": "a"}, version=1)
        await failpoints.clear()
        assert (replayed.outcome, replayed.observation.attempts, replayed.observation.transient_replays) == (
            "acked",
            2,
            1,
        )
        assert events == ["lifespan enter", "set up", "clean up", "set up", "clean up"]
        events.clear()
        failed = await tc.publish_json("notes", {"text": "b", "fail": True}, version=1)
        assert (failed.outcome, failed.code, str(failed.exception)) == (
            "dead_lettered",
            "QUEUE_RETRIES_EXHAUSTED",  # no retries configured
            "after the write",
        )
        assert events == ["set up", "clean up"]
        # The failed attempt's write was rolled back with its transaction; the replayed one committed once.
        assert [d["text"] for d in await tc.database["notes"].find({}).to_list()] == ["a"]
    assert events[-1] == "lifespan exit"


async def test_a_spent_replay_budget_keeps_and_logs_what_the_handler_raised(
    mongodb: MongoDB, failpoints: Faults, caplog: pytest.LogCaptureFixture
) -> None:
    events: list[str] = []
    async with TestConsumer(notes_consumer(mongodb, events)) as tc:
        # Every insert into notes conflicts: each attempt's handler raises, and the attempts replay.
        await failpoints.fail(
            "insert", labels=["TransientTransactionError"], times=None, namespace=f"{mongodb.name}.notes"
        )
        result = await tc.publish_json("notes", {"text": "c"}, version=1)
        await failpoints.clear()
    assert (result.outcome, result.code) == ("deferred", "REPLAY_BUDGET_SPENT")
    assert isinstance(result.exception, PyMongoError)
    assert result.exception.has_error_label("TransientTransactionError")
    [warning] = [r for r in caplog.records if r.getMessage().startswith("handler failed: OperationFailure")]
    assert warning.exc_info is not None
    assert "outcome=deferred code=REPLAY_BUDGET_SPENT" in warning.getMessage()


# -- the lifespan of a started consumer --------------------------------------------------------------


async def test_the_lifespan_is_entered_first_and_exits_after_the_drain_and_the_relay(
    broker: Broker, mongodb: MongoDB
) -> None:
    q = broker.queue("life")
    events: list[str] = []
    release = asyncio.Event()

    @queue(q, version=1, guarantee="at_least_once")
    async def slow(event_id: EventId, greeting: Annotated[str, Resource("greeting")], log: Events) -> None:
        log.append(f"handler start: {greeting}")
        await release.wait()
        log.append("handler end")

    consumer = broker.consumer(
        q, slow, mongodb=mongodb, lifespan=recording(events, greeting="hello"), graceful_timeout=20.0
    )
    managed = await consumer.start()
    await broker.publish(q)
    await eventually(lambda: "handler start: hello" in events, what="the handler to start")
    stopping = asyncio.ensure_future(managed.shutdown())
    await asyncio.sleep(0.3)  # shutdown is draining: the handler is still running
    events.append("released")
    release.set()
    report = await stopping
    assert events == ["lifespan enter", "handler start: hello", "released", "handler end", "lifespan exit"]
    names = [action.name for action in report.actions]
    assert names.index("drain") < names.index("relay_stop") < names.index("lifespan_exit")
    assert names.index("tasks_join") < names.index("lifespan_exit")
    assert report.action("lifespan_exit").ok
    assert report.succeeded, report.render()


# -- MongoDatabase for at-least-once handlers, and check_idempotent ----------------------------------


@queue("tally", version=1, handler_id="tally.v1", guarantee="at_least_once")
async def counting_tally(item: Json[dict[str, Any]], db: MongoDatabase) -> None:
    await db["tally"].update_one({"_id": "all"}, {"$inc": {"total": item["n"]}}, upsert=True)


@queue("tally", version=1, handler_id="tally.v1", guarantee="at_least_once")
async def keyed_tally(item: Json[dict[str, Any]], event_id: EventId, db: MongoDatabase) -> None:
    # Idempotent without an inbox: the effect is keyed by the event id.
    await db["tally"].update_one({"_id": str(event_id)}, {"$set": {"n": item["n"]}}, upsert=True)


async def tally_total(db: Any) -> int:
    return sum(doc.get("total", doc.get("n", 0)) for doc in await db["tally"].find({}).to_list())


def tally_consumer(mongodb: MongoDB, handler: Any) -> Consumer:
    consumer = Consumer(amqp_url=NO_BROKER, name="tally", mongo_client=mongodb.client, database="unused")
    consumer.include(handler)
    return consumer


async def test_an_at_least_once_handler_writes_through_mongo_database(mongodb: MongoDB) -> None:
    async with TestConsumer(tally_consumer(mongodb, counting_tally), database=mongodb.name) as tc:
        result = await tc.publish_json("tally", {"n": 3}, version=1)
        assert result.outcome == "acked"
        assert await tc.database["tally"].find({}).to_list() == [{"_id": "all", "total": 3}]


async def test_check_idempotent_catches_a_non_idempotent_inc_naming_the_duplicate_scenario(
    mongodb: MongoDB, failpoints: Faults
) -> None:
    with pytest.raises(AssertionError) as info:
        await check_idempotent(tally_consumer(mongodb, counting_tally), "tally", [{"n": 2}], tally_total)
    message = str(info.value)
    assert message.startswith(
        "check_idempotent: the handler is not idempotent: the end state after 'duplicate' and after "
        "'concurrent copies' differs from one clean delivery per event"
    ), message
    assert "  duplicate:\n" in message
    assert "-2\n" in message  # the diff: one clean delivery per event left 2 ...
    assert "+4\n" in message  # ... a duplicate copy left 4


async def test_check_idempotent_passes_an_at_least_once_handler_keyed_by_the_event(
    mongodb: MongoDB, failpoints: Faults
) -> None:
    await check_idempotent(tally_consumer(mongodb, keyed_tally), "tally", [{"n": 1}, {"n": 5}], tally_total)


# -- refused deliveries name their event id ----------------------------------------------------------


async def test_an_invalid_envelope_is_observed_and_logged_with_its_valid_event_id(
    mongodb: MongoDB, caplog: pytest.LogCaptureFixture
) -> None:
    event = uuid.uuid4()
    async with TestConsumer(tally_consumer(mongodb, keyed_tally), database=mongodb.name) as tc:
        headers = {"x-lily-event-id": str(event), "x-lily-schema-version": 1, "x-lily-content-kind": "json"}
        result = await tc.publish_raw("tally", headers=headers, body=b"{}")
    assert (result.outcome, result.code, result.event_id) == ("dead_lettered", "QUEUE_ENVELOPE_INVALID", event)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("delivery dead_lettered")]
    assert f"event_id={event}" in line
