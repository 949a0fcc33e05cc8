"""``lily-mongo embedded``, and the README's service running on it as written.

The README's snippet is taken from the README itself; only its port (the test
server's free one instead of 27017, which a developer's own server may hold)
and its queue name (unique per test on the shared broker) are changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from lily_mongo.embedded import available
from tests.support.broker import Broker
from tests.support.cli import cli_env, cli_process, wait_for_consumers
from tests.support.polling import eventually
from tests.support.probes import free_port
from tests.support.processes import Child

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## Your own service on the embedded MongoDB"

pytestmark = pytest.mark.skipif(not available(), reason="the embedded server needs the 'embedded' extra")


@contextlib.asynccontextmanager
async def embedded_server(*args: str) -> AsyncIterator[tuple[Child, int, str]]:
    """``lily-mongo embedded`` on a free port: its process, the port and the line it prints first (its URI);
    killed and reaped if the test leaves it running."""
    port = free_port()
    env = cli_env("amqp://unused/", "unused")
    async with cli_process("embedded", "--port", str(port), *args, env=env) as process:
        yield process, port, (await process.read_line(timeout=30)).strip()


@pytest.fixture
async def embedded() -> AsyncIterator[str]:
    async with embedded_server() as (_, _, uri):
        yield uri


async def test_embedded_answers_ping_on_its_port_and_stops_on_sigterm(tmp_path: Path) -> None:
    async with embedded_server() as (process, port, uri):
        assert uri == f"mongodb://127.0.0.1:{port}/"
        client: AsyncMongoClient[Any] = AsyncMongoClient(uri, serverSelectionTimeoutMS=10_000)
        try:
            assert (await client.admin.command("ping"))["ok"] == 1.0
        finally:
            await client.close()
        result = await process.stop(timeout=20)
    assert result.returncode == 0, result.describe()
    assert f"listening at mongodb://127.0.0.1:{port}/, in memory" in result.stderr


async def test_embedded_data_is_kept_between_runs(tmp_path: Path) -> None:
    data = tmp_path / "mongo-data"
    for run in range(2):
        async with embedded_server("--data", str(data)) as (process, _, uri):
            try:
                client: AsyncMongoClient[Any] = AsyncMongoClient(uri, serverSelectionTimeoutMS=10_000)
                try:
                    assert await client.dev.things.count_documents({}) == run  # what the earlier runs wrote
                    await client.dev.things.insert_one({"run": run})
                finally:
                    await client.close()
            finally:
                result = await process.stop(timeout=20)
        assert result.returncode == 0, result.describe()
        assert "one transaction at a time" in result.stderr


def readme_service() -> str:
    text = README.read_text(encoding="utf-8")
    section = text.split(SECTION, 1)[1]
    match = re.search(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert match is not None, "the README's embedded section has no python block"
    return match.group(1)


async def test_the_readme_service_runs_on_the_embedded_mongodb_as_written(
    broker: Broker, embedded: str, tmp_path: Path
) -> None:
    source = readme_service()
    assert 'AsyncMongoClient("mongodb://127.0.0.1:27017/")' in source  # as a reader copies it
    assert "replicaSet" not in source
    q = broker.queue("orders.created")
    port = embedded.rsplit(":", 1)[1].strip("/")
    source = source.replace("127.0.0.1:27017", f"127.0.0.1:{port}").replace('"orders.created"', repr(q))
    (tmp_path / "myservice.py").write_text(source)
    env = cli_env(broker.url, embedded)
    client: AsyncMongoClient[Any] = AsyncMongoClient(embedded, serverSelectionTimeoutMS=10_000)
    try:
        async with cli_process("run", "myservice:consumer", env=env, cwd=tmp_path) as process:
            await wait_for_consumers(broker.connection, q, process)
            event = await broker.publish(q, {"order_id": "A1", "total_cents": 500})
            await broker.publish(q, {"order_id": "A1", "total_cents": 500}, event_id=event)  # the same event again

            async def recorded() -> bool:
                return await client.shop.orders.find_one({"_id": "A1"}) is not None

            await eventually(recorded, timeout=20, what="order A1 in shop.orders", interval=0.1)
            await asyncio.sleep(1.0)  # the duplicate copy's turn
            result = await process.stop(timeout=30)
        assert result.returncode == 0, result.describe()
        assert result.stdout.startswith("shutdown succeeded"), result.describe()
        # At the default log level the work is visible: a progress line with the counts by outcome and
        # the rate, and the report's last line with the run's totals.
        progress = [line for line in result.stderr.splitlines() if "progress: " in line]
        assert progress, result.describe()
        assert "INFO" in progress[-1], result.describe()
        assert "/s): acked=1, duplicate=1; 2 since start" in progress[-1], result.describe()
        assert re.fullmatch(r"run totals: acked=1, duplicate=1 in \d+\.\d s", result.stdout.splitlines()[-1])
        assert "transactionLifetimeLimitSeconds" not in result.stderr, result.describe()
        # Both copies were ACKed (an unsettled one would be back in the queue), the order applied once.
        assert await broker.depths(q, f"{q}.dlq") == [0, 0]
        assert await client.shop.orders.find({}).to_list() == [{"_id": "A1", "total": 500}]
    finally:
        await client.close()
