"""The example "orders" service behind ``lily-mongo demo``.

An inbox handler records each order and adds its total to the customer's
running balance (a deliberately non-idempotent ``$inc``: applied twice, the
ledger check fails), and stages an ``orders.confirmed`` event in the outbox.
Flaky payments raise a retryable error once; orders without lines are
permanently invalid. The workload adds duplicate copies, poison messages and
a few transient database failures, then the run checks its own ledger.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import os
import random
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aio_pika
import pydantic
from pymongo import AsyncMongoClient
from pymongo.errors import PyMongoError

from .. import Consumer, EventId, Json, MongoScope, Publisher, QueueHandlerError, RetryCount
from .._amqp import channel_errors, connect_amqp
from .._errors import TransportError
from .._lifecycle import ManagedConsumer
from .._mongo import mongo_errors, open_mongo
from .._plan.options import RetryPolicy
from .._plan.routes import queue
from .._redact import redact_url
from .._supervision import ShutdownReport
from .options import DEFAULT_AMQP_URL

__all__ = ["DemoResult", "OrderCreated", "OrderLine", "run_demo"]


class OrderLine(pydantic.BaseModel):
    sku: str
    quantity: int = pydantic.Field(gt=0)
    unit_cents: int = pydantic.Field(ge=0)


class OrderCreated(pydantic.BaseModel):
    order_id: str
    customer: str
    lines: list[OrderLine]
    flaky_payment: bool = False

    @property
    def total_cents(self) -> int:
        return sum(line.quantity * line.unit_cents for line in self.lines)


def build_consumer(
    amqp_url: str, client: AsyncMongoClient[Any], database: str, work_queue: str, confirmed_queue: str
) -> Consumer:
    """The demo service: one inbox handler on ``work_queue``."""

    @queue(work_queue, version=1, content="json", handler_id="demo.orders.created.v1")
    async def on_order_created(
        order: Json[OrderCreated], event_id: EventId, retries: RetryCount, mongo: MongoScope
    ) -> None:
        if not order.lines:
            raise QueueHandlerError.permanent("ORDER_INVALID", "an order needs at least one line")
        if order.flaky_payment and retries == 0:
            raise QueueHandlerError.retryable("PAYMENT_DOWN", "payment gateway answered 503")
        db = mongo.database
        await db["orders"].insert_one(
            {
                "_id": order.order_id,
                "customer": order.customer,
                "total_cents": order.total_cents,
                "event_id": str(event_id),
            },
            session=mongo.session,
        )
        await db["balances"].update_one(
            {"_id": order.customer},
            {"$inc": {"total_cents": order.total_cents, "orders": 1}},
            upsert=True,
            session=mongo.session,
        )
        await mongo.outbox.publish_json(
            confirmed_queue, {"order_id": order.order_id, "total_cents": order.total_cents}, version=1
        )

    consumer = Consumer(amqp_url=amqp_url, mongo_client=client, database=database, name="orders-demo")
    consumer.configure_queue(
        work_queue, concurrency=4, prefetch=32, retry=RetryPolicy(max_retries=3, delays=(0.5, 1.0))
    )
    consumer.include(on_order_created)
    return consumer


@dataclasses.dataclass
class Workload:
    orders: list[OrderCreated]
    valid: list[OrderCreated]
    duplicates: int
    poison: int
    invalid: int
    flaky: int


def make_workload(count: int, seed: int) -> Workload:
    rng = random.Random(seed)
    customers = [f"customer-{i:03d}" for i in range(max(3, count // 10))]
    orders: list[OrderCreated] = []
    for i in range(count):
        lines = [
            OrderLine(
                sku=f"SKU-{rng.randrange(100):03d}", quantity=rng.randint(1, 5), unit_cents=rng.randint(100, 9999)
            )
            for _ in range(rng.randint(1, 4))
        ]
        invalid = rng.random() < 0.03
        orders.append(
            OrderCreated(
                order_id=f"order-{seed}-{i:05d}",
                customer=rng.choice(customers),
                lines=[] if invalid else lines,
                flaky_payment=not invalid and rng.random() < 0.05,
            )
        )
    valid = [o for o in orders if o.lines]
    return Workload(
        orders=orders,
        valid=valid,
        duplicates=max(1, count // 10),
        poison=5,
        invalid=len(orders) - len(valid),
        flaky=sum(1 for o in valid if o.flaky_payment),
    )


@dataclasses.dataclass
class DemoResult:
    """What the demo measured and whether its ledger check passed."""

    orders: int
    published_messages: int
    elapsed: float
    outcomes: dict[str, int]
    dead_lettered_by_code: dict[str, int]
    transient_replays: int
    reconciliations: int
    applied_orders: int
    expected_orders: int
    ledger_ok: bool
    ledger_problems: list[str]
    confirmed_events: int
    shutdown: ShutdownReport | None
    poison: int = 0
    """Poison messages among ``published_messages`` (no envelope, broken JSON, an unknown version, ...)."""
    injected_failures: int = 0
    """Transient database failures injected with a failpoint (0 where the server refused it)."""
    emulator: bool = False
    """The server was the embedded one (``lily_mongo.embedded``), whose write conflicts are per document."""

    @property
    def throughput(self) -> float:
        return self.published_messages / self.elapsed if self.elapsed > 0 else 0.0


_START_RABBITMQ = (
    "Start it with `rabbitmq-server -detached` (system service) or `docker compose up -d rabbitmq` "
    "(compose.yaml), or point LILY_AMQP_URL at a broker"
)


@asynccontextmanager
async def _mongo(uri: str | None) -> AsyncIterator[str]:
    if uri:
        yield uri
        return
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "lily_mongo.embedded", "--port", "0", stdout=asyncio.subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        line = (await process.stdout.readline()).decode()
        if not line.startswith("READY "):
            raise RuntimeError("the embedded MongoDB-wire server did not start (is mongoeco[wire] installed?)")
        yield line.split(None, 1)[1].strip()
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), timeout=10)
            except TimeoutError:
                process.kill()
                await process.wait()


async def check_broker(amqp_url: str) -> None:
    """Raise :class:`TransportError` (saying how to start RabbitMQ when nothing answers) unless it accepts us."""
    try:
        connection = await asyncio.wait_for(connect_amqp(amqp_url, robust=False), timeout=5)
    except TimeoutError as exc:
        message = f"RabbitMQ is not reachable at {redact_url(amqp_url)} (timed out). {_START_RABBITMQ}"
        raise TransportError(message, unreachable=True) from exc
    except TransportError as exc:
        if exc.unreachable:
            raise TransportError(f"{exc}. {_START_RABBITMQ}", unreachable=True) from exc
        raise
    await connection.close()


async def _publish_workload(amqp_url: str, work_queue: str, workload: Workload, rng: random.Random) -> int:
    """Publish every order once, some twice (same event id), plus poison messages; return messages sent."""
    sent = 0
    async with Publisher(amqp_url) as publisher:
        event_ids: list[uuid.UUID] = []
        for order in workload.orders:
            event_ids.append(await publisher.publish_json(work_queue, order, version=1))
            sent += 1
        # Duplicate copies of valid orders only: a copy of an invalid order is not a
        # duplicate for the inbox (nothing committed) and would be dead-lettered too.
        valid = [i for i, order in enumerate(workload.orders) if order.lines]
        for index in rng.sample(valid, min(workload.duplicates, len(valid))):
            await publisher.publish_json(work_queue, workload.orders[index], version=1, event_id=event_ids[index])
            sent += 1
    connection = await connect_amqp(amqp_url, robust=False)
    try:
        channel = await connection.channel(publisher_confirms=True)
        good = {"x-lily-schema-version": "1", "x-lily-content-kind": "json"}
        poison: list[tuple[dict[str, Any], bytes]] = [
            ({}, b'{"order_id": "no-headers"}'),
            ({**good, "x-lily-event-id": str(uuid.uuid4())}, b'{"order_id": '),  # broken JSON
            ({**good, "x-lily-event-id": str(uuid.uuid4()), "x-lily-schema-version": 1}, b"{}"),  # integer version
            ({**good, "x-lily-event-id": str(uuid.uuid4()), "x-lily-schema-version": "9"}, b"{}"),  # no v9 handler
            ({**good, "x-lily-event-id": "NOT-A-UUID"}, b"{}"),
        ]
        for headers, body in poison[: workload.poison]:
            await channel.default_exchange.publish(aio_pika.Message(body, headers=headers), routing_key=work_queue)
            sent += 1
    finally:
        await connection.close()
    return sent


async def _check_ledger(db: Any, workload: Workload) -> tuple[int, list[str]]:
    problems: list[str] = []
    expected_balance: dict[str, int] = collections.Counter()
    expected_count: dict[str, int] = collections.Counter()
    for order in workload.valid:
        expected_balance[order.customer] += order.total_cents
        expected_count[order.customer] += 1
    applied = await db["orders"].count_documents({})
    if applied != len(workload.valid):
        problems.append(f"{applied} orders recorded, expected {len(workload.valid)}")
    async for balance in db["balances"].find({}):
        customer = balance["_id"]
        if balance.get("total_cents") != expected_balance.get(customer) or balance.get("orders") != expected_count.get(
            customer
        ):
            problems.append(
                f"{customer}: balance {balance.get('total_cents')} over {balance.get('orders')} orders, expected "
                f"{expected_balance.get(customer)} over {expected_count.get(customer)}"
            )
    return applied, problems


async def run_demo(
    *,
    orders: int = 300,
    amqp_url: str | None = None,
    mongo_uri: str | None = None,
    seed: int | None = None,
    timeout: float = 120.0,
    transient_failures: int = 3,
    progress: Any = None,
) -> DemoResult:
    """Run the demo end to end and return what it measured; ``progress(done, total)`` is called as it goes.

    Raises lily errors only: what the AMQP client or PyMongo raise on the way is mapped.
    """
    amqp_url = amqp_url or os.environ.get("LILY_AMQP_URL", DEFAULT_AMQP_URL)
    mongo_uri = mongo_uri or os.environ.get("LILY_MONGO_URI")
    with channel_errors("running the orders demo"), mongo_errors("the orders demo", uri=mongo_uri):
        return await _run_demo(orders, amqp_url, mongo_uri, seed, timeout, transient_failures, progress)


async def _run_demo(
    orders: int,
    amqp_url: str,
    mongo_uri: str | None,
    seed: int | None,
    timeout: float,
    transient_failures: int,
    progress: Any,
) -> DemoResult:
    await check_broker(amqp_url)
    seed = seed if seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    run_id = uuid.uuid4().hex[:8]
    work_queue = f"lily.demo.orders.{run_id}"
    confirmed_queue = f"lily.demo.confirmed.{run_id}"
    database = f"lily_demo_{run_id}"
    workload = make_workload(orders, seed)
    async with _mongo(mongo_uri) as uri:
        try:
            client: AsyncMongoClient[Any] = await open_mongo(uri)
        except TransportError as exc:
            advice = "; is it running? Check LILY_MONGO_URI" if exc.unreachable else ""
            raise TransportError(f"{exc}{advice}", unreachable=exc.unreachable) from exc
        connection = await connect_amqp(amqp_url, robust=False)
        channel = await connection.channel()
        managed: ManagedConsumer | None = None
        report: ShutdownReport | None = None
        try:
            await channel.declare_queue(confirmed_queue, durable=True)
            consumer = build_consumer(amqp_url, client, database, work_queue, confirmed_queue)
            managed = await consumer.start()
            hello = await client.admin.command("hello")
            emulator = hello.get("gitVersion") == "mongoeco"  # how the embedded server names itself
            injected = 0
            if transient_failures:
                # A production server without test commands refuses this: then no injected failures.
                with contextlib.suppress(PyMongoError):
                    await client.admin.command(
                        {
                            "configureFailPoint": "failCommand",
                            "mode": {"times": transient_failures},
                            "data": {
                                "failCommands": ["insert"],
                                "errorCode": 112,
                                "errorLabels": ["TransientTransactionError"],
                            },
                        }
                    )
                    injected = transient_failures
            started = time.monotonic()
            sent = await _publish_workload(amqp_url, work_queue, workload, rng)
            expected_dlq = workload.poison + workload.invalid
            deadline = started + timeout
            db = client[database]
            while time.monotonic() < deadline:
                applied = await db["orders"].count_documents({})
                dlq = await channel.declare_queue(f"{work_queue}.dlq", passive=True)
                dead = dlq.declaration_result.message_count or 0
                confirmed = await channel.declare_queue(confirmed_queue, passive=True)
                out = confirmed.declaration_result.message_count or 0
                if progress is not None:
                    progress(applied + dead, len(workload.valid) + expected_dlq)
                snapshot = managed.snapshot()
                idle = all(q.in_flight == 0 and q.buffered == 0 for q in snapshot.queues)
                if applied >= len(workload.valid) and dead >= expected_dlq and out >= applied and idle:
                    break
                await asyncio.sleep(0.25)
            elapsed = time.monotonic() - started
            observations = managed.delivery_terminal_observations()
            final = managed.snapshot().queues[0]
            report = await managed.shutdown()
            managed = None
            applied, problems = await _check_ledger(db, workload)
            confirmed = await channel.declare_queue(confirmed_queue, passive=True)
            confirmed_events = confirmed.declaration_result.message_count or 0
            if confirmed_events < applied:
                problems.append(f"{confirmed_events} orders.confirmed events relayed, expected {applied}")
            dlq = await channel.declare_queue(f"{work_queue}.dlq", passive=True)
            dead = dlq.declaration_result.message_count or 0
            if dead != expected_dlq:
                problems.append(f"{dead} messages dead-lettered, expected {expected_dlq}")
            outcomes = dict(final.outcomes)
            by_code = collections.Counter(o.code or "?" for o in observations if o.outcome == "dead_lettered")
            return DemoResult(
                orders=len(workload.orders),
                published_messages=sent,
                elapsed=elapsed,
                outcomes=outcomes,
                dead_lettered_by_code=dict(by_code),
                transient_replays=final.transient_replays,
                reconciliations=final.reconciliations,
                applied_orders=applied,
                expected_orders=len(workload.valid),
                ledger_ok=not problems,
                ledger_problems=problems,
                confirmed_events=confirmed_events,
                shutdown=report,
                poison=workload.poison,
                injected_failures=injected,
                emulator=emulator,
            )
        finally:
            if managed is not None:
                await managed.shutdown(force=True)
            for name in (
                work_queue,
                f"{work_queue}.dlq",
                f"{work_queue}.retry.0",
                f"{work_queue}.retry.1",
                confirmed_queue,
            ):
                await channel.queue_delete(name)
            await connection.close()
            try:
                await client.drop_database(database)
            finally:
                await client.close()
