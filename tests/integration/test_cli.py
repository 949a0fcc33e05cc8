"""The ``lily-mongo`` command, run as a real subprocess (docs/operations.md section 8).

Every test starts the installed console script (or, without it, ``main()``
through ``python -c``) with ``LILY_AMQP_URL`` / ``LILY_MONGO_URI`` pointing at
the test servers, and checks what the broker and the database hold afterwards:
queue depths by passive declare, DLQ contents, inbox and outbox documents.
Subprocesses are asyncio subprocesses, so a consumer running in the test's own
event loop keeps working while the command runs; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import signal
import textwrap
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aio_pika
import aio_pika.abc
import jsonschema
import pydantic
import pytest
import yaml
from typer.testing import CliRunner
from yarl import URL

from lily_mongo import (
    Consumer,
    EventId,
    Json,
    ManagedConsumer,
    MongoScope,
    QueueHandlerError,
    RawDelivery,
    RetryCount,
    RetryPolicy,
    queue,
)
from lily_mongo._cli.app import app as cli_app
from lily_mongo.testing import Faults
from tests.support.asyncapi import resolve, version_and_content
from tests.support.broker import Broker, consumer_count, wait_for_depth
from tests.support.cli import (
    EventLog,
    cli_env,
    cli_process,
    logging_restored,
    one_error_line,
    run_cli,
    run_error_line,
    wait_for_consumers,
    write_service,
)
from tests.support.consumers import outcomes, running
from tests.support.mongo import MongoDB
from tests.support.polling import eventually
from tests.support.processes import Child, Completed

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "data" / "asyncapi-3.0.0.schema.json"
ENVELOPE = ("x-lily-event-id", "x-lily-schema-version", "x-lily-content-kind")
EFFECTS = "effects"
COMPLETIONS = "lily_inbox"
CLOSED_PORT_AMQP_URL = "amqp://guest:guest@127.0.0.1:1/"


@dataclasses.dataclass(frozen=True)
class Service:
    """``lily-mongo run svcmod:consumer`` consuming ``q``; its handler writes ``log``."""

    q: str
    process: Child
    log: EventLog


RunningService = Callable[..., contextlib.AbstractAsyncContextManager[Service]]


@pytest.fixture
def running_service(env: dict[str, str], broker: Broker, tmp_path: Path) -> RunningService:
    """Runs the service module of :func:`write_service` on a fresh queue (named after ``base``) until
    the block ends, once its consumer is attached."""

    @contextlib.asynccontextmanager
    async def run(base: str, *, force_timeout: float = 5.0) -> AsyncIterator[Service]:
        q = broker.queue(base)
        log = write_service(tmp_path, q, force_timeout=force_timeout)
        async with cli_process("run", "svcmod:consumer", env=env, cwd=tmp_path) as process:
            await wait_for_consumers(broker.connection, q, process)
            yield Service(q, process, log)

    return run


async def force_during(service: Service, event: uuid.UUID) -> Completed:
    """Once the service's handler runs ``event``: SIGINT, and a second one 1.5 s later that forces (a
    second signal within a second of the first is part of its burst); the command's result."""
    await service.log.wait_for(f"start {event}")
    service.process.send_signal(signal.SIGINT)
    await asyncio.sleep(1.5)
    return await service.process.stop(timeout=20, number=signal.SIGINT)


@pytest.fixture
def env(amqp: str, mongo_uri: str) -> dict[str, str]:
    """The command's environment, pointing at the test servers."""
    return cli_env(amqp, mongo_uri)


# -- run --------------------------------------------------------------------------------------------


async def test_run_consumes_and_sigterm_shuts_down_gracefully(broker: Broker, running_service: RunningService) -> None:
    async with running_service("run") as service:
        q, process, log = service.q, service.process, service.log
        event = await broker.publish(q, {"n": 1})
        await log.wait_for(f"done {event}")
        result = await process.stop(timeout=20)
    assert result.returncode == 0, result.describe()
    assert "shutdown succeeded" in result.stdout, result.describe()
    assert "(forced)" not in result.stdout
    assert log.lines() == [f"start {event}", f"done {event}"]
    # The delivery was ACKed: nothing back in the queue, nothing dead-lettered, no consumer left.
    assert await broker.wait_for_depth(q, 0) == 0
    assert await broker.depth(f"{q}.dlq") == 0
    assert await consumer_count(broker.connection, q) == 0


async def test_run_second_signal_forces_and_requeues_the_running_delivery(
    broker: Broker, running_service: RunningService
) -> None:
    async with running_service("force") as service:
        q, log = service.q, service.log
        event = await broker.publish(q, {"sleep": 60})
        result = await force_during(service, event)
    assert result.stdout.startswith("shutdown FORCED; unresolved deliveries: 0"), result.describe()
    assert f"cancelled {event}" in log.lines()
    assert f"done {event}" not in log.lines()
    # A forced shutdown is not an application failure: the copy is back in Q with its retry count untouched.
    assert await broker.wait_for_depth(q, 1) == 1, result.describe()
    assert await broker.depth(f"{q}.dlq") == 0
    assert await broker.depth(f"{q}.retry.0") == 0
    (message,) = await broker.drain(q)
    headers = message.headers or {}
    assert headers.get("x-lily-event-id") == str(event)
    assert headers.get("x-retry-count", 0) == 0


async def test_run_forced_shutdown_exits_with_status_1(broker: Broker, running_service: RunningService) -> None:
    async with running_service("forcerc") as service:
        event = await broker.publish(service.q, {"sleep": 60})
        result = await force_during(service, event)
    assert "shutdown FORCED" in result.stdout, result.describe()
    assert "succeeded" not in result.stdout, result.describe()
    assert result.returncode == 1, result.describe()


async def test_run_forced_shutdown_with_an_uncooperative_handler_reports_unresolved(
    broker: Broker, running_service: RunningService
) -> None:
    async with running_service("stubborn", force_timeout=0.5) as service:
        q = service.q
        event = await broker.publish(q, {"sleep": 60, "stubborn": True})
        result = await force_during(service, event)
    assert result.returncode == 1, result.describe()
    first = result.stdout.splitlines()[0]
    assert "shutdown FAILED (forced)" in first, result.describe()
    assert "unresolved deliveries: 1" in first, result.describe()
    # Never ACKed and never handed off: the broker gets the delivery back when the channel closes.
    assert await broker.wait_for_depth(q, 1) == 1
    assert await broker.depth(f"{q}.dlq") == 0


async def test_run_with_a_bad_target_fails_without_a_traceback(env: dict[str, str], tmp_path: Path) -> None:
    result = await run_cli("run", "no_such_module_here:consumer", env=env, cwd=tmp_path)
    assert result.returncode == 2, result.describe()
    assert "no_such_module_here" in one_error_line(result)


TARGETS = """
    from __future__ import annotations

    import pydantic

    from lily_mongo import Bytes, Consumer, queue


    class Settings(pydantic.BaseModel):
        url: str = "amqp://guest:guest@127.0.0.1/"


    @queue("cli.targets", version=1, content="binary")
    async def handler(body: Bytes) -> None: ...


    async def make_consumer_async() -> Consumer:
        return Consumer(amqp_url="amqp://guest:guest@127.0.0.1/", name="async")


    def make_empty() -> Consumer:
        return Consumer(amqp_url="amqp://guest:guest@127.0.0.1/", name="empty")
"""


@pytest.mark.parametrize(
    ("command", "target", "says"),
    [
        ("run", "targets:Settings", "is a class (Settings), not a lily_mongo.Consumer"),
        ("run", "targets:handler", "is a @queue handler, not a lily_mongo.Consumer"),
        ("run", "targets:make_consumer_async", "is an async function, not a lily_mongo.Consumer"),
        ("asyncapi", "targets:make_empty", "the consumer has no handlers"),
    ],
)
async def test_a_target_that_is_not_a_runnable_consumer_is_refused_in_one_line(
    env: dict[str, str], tmp_path: Path, command: str, target: str, says: str
) -> None:
    (tmp_path / "targets.py").write_text(textwrap.dedent(TARGETS))
    result = await run_cli(command, target, env=env, cwd=tmp_path)
    assert result.returncode == 2, result.describe()
    assert says in one_error_line(result)
    assert "never awaited" not in result.stderr  # the async factory was not called on a guess


# -- asyncapi ---------------------------------------------------------------------------------------

SHOP_SERVICE = """
    from __future__ import annotations

    import pydantic

    from lily_mongo import Bytes, Consumer, Json, RetryPolicy, Text, queue

    ORDERS = "shop.orders.created"
    FILES = "shop.files"


    class Line(pydantic.BaseModel):
        sku: str
        quantity: int


    class OrderPlaced(pydantic.BaseModel):
        order_reference_code: str
        lines: list[Line]


    @queue(ORDERS, version=1, content="json")
    async def order_v1(order: Json[OrderPlaced]) -> None:
        pass


    @queue(ORDERS, version=2, content="text")
    async def order_v2_text(note: Text) -> None:
        pass


    @queue(FILES, version=1, content="binary")
    async def file_v1(blob: Bytes) -> None:
        pass


    def make_consumer() -> Consumer:
        consumer = Consumer(amqp_url="amqp://guest:guest@127.0.0.1:5672/", name="shop")
        consumer.configure_queue(ORDERS, retry=RetryPolicy(max_retries=3, delays=(0.5, 2.0)))
        consumer.configure_queue(FILES, retry=RetryPolicy(max_retries=0, delays=()))
        consumer.include(order_v1, order_v2_text, file_v1)
        consumer.sends("shop.orders.placed", version=1, payload=OrderPlaced)
        return consumer


    consumer = make_consumer()
"""


@pytest.fixture(scope="module")
def asyncapi_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(json.loads(SCHEMA_PATH.read_text(encoding="utf-8")))


async def shop_asyncapi(tmp_path: Path, env: dict[str, str], fmt: str, target: str = "shop:consumer") -> str:
    (tmp_path / "shop.py").write_text(textwrap.dedent(SHOP_SERVICE))
    result = await run_cli("asyncapi", target, "--format", fmt, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.describe()
    return result.stdout


async def test_asyncapi_json_validates_and_describes_the_plan(
    env: dict[str, str], tmp_path: Path, asyncapi_validator: jsonschema.Draft7Validator
) -> None:
    document = json.loads(await shop_asyncapi(tmp_path, env, "json"))
    asyncapi_validator.validate(document)
    assert document["asyncapi"] == "3.0.0"
    channels = {c["address"]: c for c in document["channels"].values()}
    assert set(channels) == {
        "shop.orders.created",
        "shop.orders.created.retry.0",
        "shop.orders.created.retry.1",
        "shop.orders.created.dlq",
        "shop.files",
        "shop.files.dlq",
        "shop.orders.placed",
    }
    operations = list(document["operations"].values())
    assert sorted((op["action"], resolve(document, op["channel"]["$ref"])["address"]) for op in operations) == [
        ("receive", "shop.files"),
        ("receive", "shop.orders.created"),
        ("send", "shop.orders.placed"),
    ]

    def messages(address: str) -> dict[tuple[str, str], dict[str, Any]]:
        refs = channels[address]["messages"].values()
        return {version_and_content(m): m for m in (resolve(document, r["$ref"]) for r in refs)}

    orders = messages("shop.orders.created")
    assert set(orders) == {("1", "json"), ("2", "text")}
    assert set(messages("shop.files")) == {("1", "binary")}
    assert set(messages("shop.orders.created.retry.0")) == set(orders)
    payload = orders[("1", "json")]["payload"]
    assert "order_reference_code" in payload["properties"]
    line_ref = payload["properties"]["lines"]["items"]["$ref"]
    assert line_ref.startswith("#/components/schemas/")
    assert set(resolve(document, line_ref)["properties"]) == {"sku", "quantity"}
    assert orders[("2", "text")]["payload"]["type"] == "string"
    for message in [*orders.values(), *messages("shop.files").values()]:
        assert set(ENVELOPE) <= set(message["headers"]["required"])
    (dead,) = [resolve(document, r["$ref"]) for r in channels["shop.orders.created.dlq"]["messages"].values()]
    (library_copy,) = [branch for branch in dead["headers"]["anyOf"] if "x-lily-failure-code" in branch["required"]]
    assert library_copy["properties"]["x-lily-failed-queue"]["const"] == "shop.orders.created"


async def test_asyncapi_yaml_is_the_same_document(env: dict[str, str], tmp_path: Path) -> None:
    from_json = json.loads(await shop_asyncapi(tmp_path, env, "json"))
    from_yaml = yaml.safe_load(await shop_asyncapi(tmp_path, env, "yaml", target="shop:make_consumer"))
    assert from_yaml == from_json


async def test_asyncapi_validator_rejects_broken_copies(
    env: dict[str, str], tmp_path: Path, asyncapi_validator: jsonschema.Draft7Validator
) -> None:
    document = json.loads(await shop_asyncapi(tmp_path, env, "json"))
    asyncapi_validator.validate(document)
    without_version = {k: v for k, v in document.items() if k != "asyncapi"}
    with pytest.raises(jsonschema.ValidationError):
        asyncapi_validator.validate(without_version)
    bogus = json.loads(json.dumps(document))
    next(iter(bogus["operations"].values()))["action"] = "bogus"
    with pytest.raises(jsonschema.ValidationError):
        asyncapi_validator.validate(bogus)


async def test_asyncapi_rejects_a_target_that_is_not_a_consumer(env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "notaconsumer.py").write_text("VALUE = 42\n")
    result = await run_cli("asyncapi", "notaconsumer:VALUE", env=env, cwd=tmp_path)
    assert result.returncode == 2, result.describe()
    assert "not a lily_mongo.Consumer" in " ".join(result.stderr.split())


# -- dlq list / dlq replay --------------------------------------------------------------------------


class Item(pydantic.BaseModel):
    n: int
    reject: bool = False


@dataclasses.dataclass
class Seen:
    event_id: uuid.UUID
    retries: int
    headers: dict[str, Any]


@dataclasses.dataclass
class DlqService:
    q: str
    handler_id: str
    switch: asyncio.Event
    seen: list[Seen]
    consumer: Consumer

    @property
    def dlq(self) -> str:
        return f"{self.q}.dlq"

    async def dead_letter(self, broker: Broker, *ns: int, **options: Any) -> list[uuid.UUID]:
        """Publish one rejected item per ``n``; return their event ids once all of them are in the DLQ."""
        events = [await broker.publish(self.q, {"n": n, "reject": True}, **options) for n in ns]
        assert await broker.wait_for_depth(self.dlq, len(events)) == len(events)
        return events


def dlq_service(broker: Broker, mongodb: MongoDB, q: str) -> DlqService:
    """An inbox handler that rejects ``reject`` payloads permanently until ``switch`` is set."""
    switch = asyncio.Event()
    seen: list[Seen] = []
    handler_id = f"{q}/items"

    @queue(q, version=1, content="json", handler_id=handler_id)
    async def on_item(
        item: Json[Item], event_id: EventId, retries: RetryCount, raw: RawDelivery, mongo: MongoScope
    ) -> None:
        seen.append(Seen(event_id, retries, dict(raw.headers)))
        if item.reject and not switch.is_set():
            raise QueueHandlerError.permanent("ITEM_REJECTED", "the switch is off")
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id), "n": item.n}, session=mongo.session)

    retry = RetryPolicy(max_retries=2, delays=(0.2,))
    consumer = broker.consumer(
        q, on_item, name="dlq-cli", mongodb=mongodb, graceful_timeout=10.0, concurrency=1, prefetch=4, retry=retry
    )
    return DlqService(q, handler_id, switch, seen, consumer)


def final_outcomes(managed: ManagedConsumer) -> list[str]:
    """Terminal outcomes without "deferred": the emulator's write conflicts may defer a copy, which comes back."""
    return [o.outcome for o in managed.delivery_terminal_observations() if o.outcome != "deferred"]


def count_outcome(managed: ManagedConsumer, outcome: str) -> int:
    return sum(o.outcome == outcome for o in managed.delivery_terminal_observations())


async def effects_of(mongodb: MongoDB, event_id: uuid.UUID) -> int:
    return await mongodb.db[EFFECTS].count_documents({"event_id": str(event_id)})


async def test_dlq_list_shows_without_consuming_and_replay_reprocesses_once(
    env: dict[str, str], broker: Broker, mongodb: MongoDB
) -> None:
    service = dlq_service(broker, mongodb, broker.queue("dlq"))
    q, dlq = service.q, service.dlq
    async with running(service.consumer) as managed:
        [event] = await service.dead_letter(broker, 7, retry_count=2)

        listed = await run_cli("dlq", "list", q, "--json", env=env)
        assert listed.returncode == 0, listed.describe()
        rows = [json.loads(line) for line in listed.stdout.splitlines() if line.strip()]
        assert len(rows) == 1, listed.describe()
        assert rows[0]["event_id"] == str(event)
        assert rows[0]["code"] == "ITEM_REJECTED"
        assert rows[0]["retry_count"] == 2
        failed_at = datetime.datetime.fromisoformat(rows[0]["failed_at"])
        assert failed_at.tzinfo is not None
        assert abs((datetime.datetime.now(datetime.UTC) - failed_at).total_seconds()) < 60
        assert await broker.wait_for_depth(dlq, 1) == 1  # listing leaves it there
        assert await broker.depth(q) == 0
        assert len(service.seen) == 1

        service.switch.set()
        replayed = await run_cli("dlq", "replay", q, "--event-id", str(event), "--reset-retries", env=env)
        assert replayed.returncode == 0, replayed.describe()
        assert "replayed 1 message(s)" in " ".join(replayed.stdout.split()), replayed.describe()

        async def applied() -> bool:
            return await effects_of(mongodb, event) == 1

        await eventually(applied, timeout=15.0, what="the replayed event's effect", interval=0.05)
        assert await broker.wait_for_depth(dlq, 0) == 0
    assert final_outcomes(managed) == ["dead_lettered", "acked"]
    assert await effects_of(mongodb, event) == 1
    assert await mongodb.db[COMPLETIONS].count_documents({"event_id": str(event)}) == 1
    assert {s.event_id for s in service.seen} == {event}
    assert len(service.seen) >= 2
    replay = service.seen[-1]
    assert replay.retries == 0  # --reset-retries; the DLQ copy carried 2
    assert "x-lily-failure-code" not in replay.headers
    assert await broker.depths(q, dlq) == [0, 0]


async def test_dlq_replay_all_moves_every_message(env: dict[str, str], broker: Broker, mongodb: MongoDB) -> None:
    service = dlq_service(broker, mongodb, broker.queue("dlqall"))
    q, dlq = service.q, service.dlq
    async with running(service.consumer) as managed:
        events = await service.dead_letter(broker, 1, 2)
        service.switch.set()
        replayed = await run_cli("dlq", "replay", q, "--all", env=env)
        assert replayed.returncode == 0, replayed.describe()
        assert "replayed 2 message(s)" in " ".join(replayed.stdout.split()), replayed.describe()

        async def applied() -> bool:
            return all([await effects_of(mongodb, e) == 1 for e in events])

        await eventually(applied, timeout=15.0, what="both replayed effects", interval=0.05)
        assert await broker.wait_for_depth(dlq, 0) == 0
    for event in events:
        assert await effects_of(mongodb, event) == 1
    assert {s.event_id for s in service.seen} == set(events)
    assert sorted(final_outcomes(managed)) == ["acked", "acked", "dead_lettered", "dead_lettered"]
    assert await broker.depths(q, dlq) == [0, 0]


async def test_dlq_replay_of_an_event_id_no_message_carries_fails_and_leaves_the_message(
    env: dict[str, str], broker: Broker, mongodb: MongoDB
) -> None:
    service = dlq_service(broker, mongodb, broker.queue("dlqmiss"))
    q, dlq = service.q, service.dlq
    async with running(service.consumer):
        [event] = await service.dead_letter(broker, 3)
        # Switched on: a wrongly replayed copy would be processed and leave the DLQ for good.
        service.switch.set()
        other = uuid.uuid4()
        replayed = await run_cli("dlq", "replay", q, "--event-id", str(other), env=env)
        assert replayed.returncode == 1, replayed.describe()
        assert "replayed 0 message(s)" in " ".join(replayed.stdout.split()), replayed.describe()
        line = one_error_line(replayed)
        assert str(other) in line
        assert "1 message(s) inspected" in line
    # The consumer has drained and stopped: anything replayed would be in Q or applied by now.
    assert await broker.depth(q) == 0
    assert await effects_of(mongodb, event) == 0
    assert len(service.seen) == 1
    (left,) = await broker.drain(dlq)
    assert (left.headers or {}).get("x-lily-event-id") == str(event)


async def test_dlq_replay_without_a_selection_is_refused(env: dict[str, str], broker: Broker) -> None:
    q = broker.queue("dlqnone")
    await broker.channel.declare_queue(f"{q}.dlq", durable=True)
    await broker.channel.default_exchange.publish(
        aio_pika.Message(b"{}", headers={"x-lily-event-id": str(uuid.uuid4())}), routing_key=f"{q}.dlq"
    )
    assert await broker.wait_for_depth(f"{q}.dlq", 1) == 1
    result = await run_cli("dlq", "replay", q, env=env)
    assert result.returncode == 2, result.describe()
    assert "--event-id" in one_error_line(result)
    assert await broker.depth(f"{q}.dlq") == 1


# -- inbox stats ------------------------------------------------------------------------------------


async def test_inbox_stats_counts_completions_and_outbox_per_handler(
    env: dict[str, str], broker: Broker, mongodb: MongoDB
) -> None:
    q_orders, q_audit, q_out = broker.queue("stats"), broker.queue("audit"), broker.queue("out")
    await broker.channel.declare_queue(q_out, durable=True)

    @queue(q_orders, version=1, content="json", handler_id="stats.orders.v1")
    async def on_order(item: Json[Item], event_id: EventId, mongo: MongoScope) -> None:
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id)}, session=mongo.session)
        await mongo.outbox.publish_json(q_out, {"n": item.n}, version=1)

    @queue(q_audit, version=1, content="json", handler_id="stats.audit.v1")
    async def on_audit(item: Json[Item], event_id: EventId, mongo: MongoScope) -> None:
        await mongo.database[EFFECTS].insert_one({"event_id": str(event_id)}, session=mongo.session)

    queues: dict[str, Any] = {"concurrency": 1, "prefetch": 4, "retry": RetryPolicy(max_retries=1, delays=(0.2,))}
    consumer = broker.consumer(
        (q_orders, q_audit), on_order, on_audit, name="stats", mongodb=mongodb, graceful_timeout=10.0, **queues
    )
    outbox = mongodb.db["lily_outbox"]
    async with running(consumer) as managed:
        events = [await broker.publish(q_orders, {"n": n}) for n in range(3)]
        await broker.publish(q_audit, {"n": 99})

        async def all_settled() -> bool:
            return count_outcome(managed, "acked") == 4

        await eventually(all_settled, timeout=15.0, what="four deliveries acked", interval=0.05)
        await broker.publish(q_orders, {"n": 0}, event_id=events[0])  # a duplicate copy

        async def duplicate_absorbed() -> bool:
            return count_outcome(managed, "duplicate") == 1

        async def relayed() -> bool:
            return await outbox.count_documents({"status": "published"}) == 3

        await eventually(duplicate_absorbed, timeout=15.0, what="the duplicate settled", interval=0.05)
        await eventually(relayed, timeout=15.0, what="three outbox records published", interval=0.05)
    assert sorted(final_outcomes(managed)) == ["acked", "acked", "acked", "acked", "duplicate"]
    assert await broker.depth(q_out) == 3

    result = await run_cli("inbox", "stats", mongodb.name, "--mongo-uri", mongodb.uri, "--json", env=env)
    assert result.returncode == 0, result.describe()
    stats = json.loads(result.stdout)
    assert stats == {
        "stats.orders.v1": {
            "completed": 3,
            "live_leases": 0,
            "stale_leases": 0,
            "outbox_pending": 0,
            "outbox_published": 3,
            "outbox_failed": 0,
        },
        "stats.audit.v1": {
            "completed": 1,
            "live_leases": 0,
            "stale_leases": 0,
            "outbox_pending": 0,
            "outbox_published": 0,
            "outbox_failed": 0,
        },
    }


# -- demo -------------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
async def test_demo_passes_its_ledger_check(env: dict[str, str], failpoints: Faults) -> None:
    # The demo injects transient failures with a failCommand failpoint on this server; the
    # `failpoints` fixture switches it off afterwards whatever happens.
    result = await run_cli("demo", "--orders", "40", "--timeout", "120", "--seed", "2", env=env, timeout=150)
    assert result.returncode == 0, result.describe()
    (ledger,) = [line for line in result.stdout.splitlines() if "ledger check" in line]
    assert "PASS" in ledger, result.describe()
    assert "ledger:" not in result.stdout  # no ledger problem lines
    legend = " ".join(result.stdout.split("legend:", 1)[1].split())  # wrapped to the console's width
    assert "duplicate copies (same event id) and 5 poison messages" in legend
    assert "deferred: requeued without spending a retry" in legend
    assert "published events: orders.confirmed events the outbox published" in legend
    if "replicaSet" not in env["LILY_MONGO_URI"]:  # the embedded emulator
        assert "the embedded server conflicts per document, as MongoDB does" in legend
    assert "global" not in legend


async def test_demo_without_a_broker_says_how_to_start_one(mongo_uri: str) -> None:
    result = await run_cli("demo", "--orders", "10", env=cli_env(CLOSED_PORT_AMQP_URL, mongo_uri), timeout=30)
    assert result.returncode == 3, result.describe()
    message = " ".join(result.stderr.split())
    assert "RabbitMQ is not reachable" in message, result.describe()
    assert "rabbitmq-server -detached" in message
    assert "docker compose up -d rabbitmq" in message
    assert "guest:guest" not in message  # the URL is shown with its password redacted
    assert "Traceback" not in result.stderr


# -- errors: one line, a documented exit status, never a traceback or a password ---------------------

SECRET = "S3cr3t-p@ss"


def with_password(url: str, password: str = SECRET) -> str:
    return str(URL(url).with_password(password))


def closed_port(url: str) -> str:
    return str(URL(url).with_port(1))


async def test_dlq_list_of_a_missing_queue_is_a_usage_error(env: dict[str, str]) -> None:
    result = await run_cli("dlq", "list", "lt.no-such-queue-here", env=env)
    assert result.returncode == 2, result.describe()
    assert "queue 'lt.no-such-queue-here.dlq' does not exist" in one_error_line(result)


@pytest.mark.parametrize(
    "args",
    [
        ("dlq", "list", "orders"),
        ("dlq", "replay", "orders", "--all"),
    ],
)
async def test_bad_credentials_are_refused_not_unreachable(
    env: dict[str, str], amqp: str, args: tuple[str, ...]
) -> None:
    result = await run_cli(*args, "--amqp-url", with_password(amqp), env=env)
    assert result.returncode == 3, result.describe()
    line = one_error_line(result)
    assert "refused the login" in line
    assert "not reachable" not in line
    assert SECRET not in result.stderr + result.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("dlq", "list", "orders"),
        ("dlq", "replay", "orders", "--event-id", "0f8fad5b-d9cb-469f-a165-70867728950e"),
    ],
)
async def test_a_closed_port_is_unreachable_in_one_line(env: dict[str, str], amqp: str, args: tuple[str, ...]) -> None:
    url = closed_port(with_password(amqp))
    result = await run_cli(*args, "--amqp-url", url, env=env)
    assert result.returncode == 3, result.describe()
    line = one_error_line(result)
    assert "RabbitMQ is not reachable" in line
    assert "--amqp-url" in line  # what to do
    assert SECRET not in result.stderr + result.stdout


async def test_a_missing_virtual_host_is_named(env: dict[str, str], amqp: str) -> None:
    url = str(URL(amqp).with_path("/no-such-vhost"))
    result = await run_cli("dlq", "list", "orders", "--amqp-url", url, env=env)
    assert result.returncode == 3, result.describe()
    line = one_error_line(result)
    assert "virtual host 'no-such-vhost'" in line
    assert "object at 0x" not in line


async def test_inbox_stats_with_mongodb_unreachable(env: dict[str, str]) -> None:
    uri = f"mongodb://app:{urllib.parse.quote_plus(SECRET)}@127.0.0.1:1/?serverSelectionTimeoutMS=300"
    result = await run_cli("inbox", "stats", "shop", "--mongo-uri", uri, env=env)
    assert result.returncode == 3, result.describe()
    line = one_error_line(result)
    assert "MongoDB is not reachable at mongodb://app:***@127.0.0.1:1/" in line
    assert "--mongo-uri" in line
    assert urllib.parse.quote_plus(SECRET) not in result.stderr + result.stdout


async def test_inbox_stats_with_an_invalid_mongodb_uri_is_a_usage_error(env: dict[str, str]) -> None:
    uri = f"mongodb://app:{SECRET}@127.0.0.1:1/"  # PyMongo wants the '@' in a password escaped
    result = await run_cli("inbox", "stats", "shop", "--mongo-uri", uri, env=env)
    assert result.returncode == 2, result.describe()
    assert "the MongoDB URI mongodb://app:***@127.0.0.1:1/ is not valid" in one_error_line(result)
    assert SECRET not in result.stderr + result.stdout


async def test_demo_with_mongodb_unreachable_says_which_and_how(amqp: str) -> None:
    unreachable = "mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=300"
    result = await run_cli("demo", "--orders", "10", env=cli_env(amqp, unreachable), timeout=60)
    assert result.returncode == 3, result.describe()
    assert "Traceback" not in result.stderr + result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.describe()
    assert "MongoDB is not reachable" in errors[0]
    assert "LILY_MONGO_URI" in errors[0]


async def test_run_with_an_unreachable_broker_exits_3_without_the_password(
    env: dict[str, str], amqp: str, tmp_path: Path
) -> None:
    # A password holding '@': shown as *** whole, never in part.
    url = closed_port(with_password(amqp, "P@ssw0rd"))
    source = f"""
        from lily_mongo import Bytes, Consumer, queue

        @queue("cli.unreachable", version=1, content="binary")
        async def handler(body: Bytes) -> None: ...

        consumer = Consumer(amqp_url={url!r}, name="unreachable")
        consumer.include(handler)
    """
    (tmp_path / "unreachable.py").write_text(textwrap.dedent(source))
    result = await run_cli("run", "unreachable:consumer", env=env, cwd=tmp_path)
    assert result.returncode == 3, result.describe()
    line = run_error_line(result)
    assert "RabbitMQ is not reachable at amqp://guest:***@127.0.0.1:1/" in line
    assert "ssw0rd" not in result.stderr + result.stdout


async def test_debug_shows_the_traceback_without_locals_or_the_password(env: dict[str, str], amqp: str) -> None:
    url = closed_port(with_password(amqp))
    result = await run_cli("--debug", "dlq", "list", "orders", "--amqp-url", url, env=env)
    assert result.returncode == 3, result.describe()
    assert "Traceback" in result.stderr
    assert "locals" not in result.stderr  # rich's locals panel
    assert SECRET not in result.stderr + result.stdout
    assert result.stderr.strip().splitlines()[-1].startswith("error: RabbitMQ is not reachable")


@pytest.mark.parametrize(
    "args",
    [
        (),
        ("dlq",),
        ("dlq", "list"),
        ("dlq", "replay"),
        ("inbox", "stats"),
        ("run",),
        ("asyncapi",),
        ("demo",),
        ("embedded",),
    ],
)
def test_help_documents_the_exit_status(args: tuple[str, ...]) -> None:
    with logging_restored():
        result = CliRunner().invoke(cli_app, [*args, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.replace("│", " ").split())
    assert "Exit status: 0 success; 1 the command failed" in text
    assert "3 RabbitMQ or MongoDB unreachable or refusing the connection" in text


# -- dlq: selections, whole ids, totals, quorum DLQs, untrusted codes --------------------------------


async def fill_dlq(channel: aio_pika.abc.AbstractChannel, dlq: str, *headers: dict[str, Any]) -> list[str]:
    """Publish one message per header table straight into ``dlq``; return their event ids."""
    ids = []
    for table in headers:
        event_id = str(uuid.uuid4())
        message = aio_pika.Message(b"{}", headers={"x-lily-event-id": event_id, **table})
        await channel.default_exchange.publish(message, routing_key=dlq)
        ids.append(event_id)
    assert await wait_for_depth(channel, dlq, len(ids)) == len(ids)
    return ids


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--all", "--event-id", "0f8fad5b-d9cb-469f-a165-70867728950e"), "not both"),
        (("--event-id", "order-7"), "event id 'order-7' is not a UUID"),
        (("--event-id", "00000000-0000-0000-0000-000000000000"), "nil UUID"),
    ],
)
async def test_dlq_replay_refuses_a_bad_selection_and_moves_nothing(
    env: dict[str, str], broker: Broker, args: tuple[str, ...], says: str
) -> None:
    q = broker.queue("dlqsel")
    await broker.channel.declare_queue(q, durable=True)
    await broker.channel.declare_queue(f"{q}.dlq", durable=True)
    await fill_dlq(broker.channel, f"{q}.dlq", {}, {}, {})
    result = await run_cli("dlq", "replay", q, *args, env=env)
    assert result.returncode == 2, result.describe()
    assert says in one_error_line(result)
    assert await broker.depth(f"{q}.dlq") == 3
    assert await broker.depth(q) == 0


async def test_dlq_list_prints_whole_event_ids_and_the_total(env: dict[str, str], broker: Broker) -> None:
    q = broker.queue("dlqwide")
    await broker.channel.declare_queue(f"{q}.dlq", durable=True)
    ids = await fill_dlq(broker.channel, f"{q}.dlq", {}, {}, {})
    narrow = {**env, "COLUMNS": "80"}  # a narrow terminal
    result = await run_cli("dlq", "list", q, "--limit", "2", env=narrow)
    assert result.returncode == 0, result.describe()
    assert ids[0] in result.stdout
    assert ids[1] in result.stdout
    assert ids[2] not in result.stdout  # over the limit
    assert f"{q}.dlq: 3 message(s), 2 listed" in " ".join(result.stdout.split())
    assert await broker.depth(f"{q}.dlq") == 3


async def test_dlq_list_tells_broker_dead_letters_from_library_copies(env: dict[str, str], broker: Broker) -> None:
    q = broker.queue("dlqorigin")

    @queue(q, version=1, content="json")
    async def handle(item: Json[Item]) -> None:
        raise QueueHandlerError.permanent("ITEM_REJECTED", "rejected by the handler")

    consumer = Consumer(amqp_url=broker.url, name="origin")
    consumer.configure_queue(q, max_body=64, retry=RetryPolicy(max_retries=0, delays=()))
    consumer.include(handle)
    forged = {
        "x-lily-schema-version": "1",
        "x-lily-content-kind": "json",
        "x-lily-failure-code": "FORGED_BY_PRODUCER",
        "x-lily-failed-queue": q,
    }
    oversize = str(uuid.uuid4())
    rejected = str(uuid.uuid4())
    async with running(consumer) as managed:
        # Over max_body: rejected, the broker dead-letters the original with its forged header.
        await broker.channel.default_exchange.publish(
            aio_pika.Message(b"{" + b" " * 100 + b"}", headers={"x-lily-event-id": oversize, **forged}),
            routing_key=q,
        )
        # Valid, refused by the handler: the library copy (the forged code is replaced).
        await broker.channel.default_exchange.publish(
            aio_pika.Message(b'{"n": 1}', headers={"x-lily-event-id": rejected, **forged}), routing_key=q
        )
        await eventually(lambda: len(outcomes(managed)) == 2, what="both deliveries settled", interval=0.05)
    assert await broker.wait_for_depth(f"{q}.dlq", 2) == 2
    table = await run_cli("dlq", "list", q, env=env)
    assert table.returncode == 0, table.describe()
    rows = {line.split("│")[1].strip(): line for line in table.stdout.splitlines() if line.count("│") > 2}
    assert "broker-native (rejected); x-lily-failure-code FORGED_BY_PRODUCER" in rows[oversize]
    assert " library " in rows[rejected]
    assert "ITEM_REJECTED" in rows[rejected]
    assert "FORGED" not in rows[rejected]
    assert "(untrusted)" in table.stdout
