"""``lily-mongo relay``: the backstop relay as a command, run as a real subprocess (docs/outbox.md, docs/operations.md).

Records are written by ``Outbox.transaction`` with no consumer and no dispatcher
running; the command publishes them once, with the canonical envelope, serves
``/readyz`` and ``/metrics`` with ``--http-port``, and stops with status 0 on SIGTERM.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import aiohttp
import orjson
from typer.testing import CliRunner

from lily_mongo import Outbox, OutboxTransaction
from lily_mongo._cli.app import app as cli_app
from lily_mongo.envelope import validate_envelope
from tests.support.broker import Broker
from tests.support.cli import cli_env, cli_process, logging_restored, one_error_line, run_cli
from tests.support.mongo import MongoDB
from tests.support.polling import eventually
from tests.support.probes import answers, free_port, get

OUTBOX = "lily_outbox"


async def test_records_written_without_a_consumer_are_delivered_once_by_the_relay_command(
    broker: Broker, mongodb: MongoDB, tmp_path: Path
) -> None:
    down = await broker.declare(broker.queue("down"))
    outbox = Outbox(mongodb.client, mongodb.name, name="script")
    given = uuid.uuid4()

    async def place(tx: OutboxTransaction) -> list[uuid.UUID]:
        await tx.database["orders"].insert_one({"_id": "o1"}, session=tx.session)
        return [
            await tx.publish_json(down, {"order_id": "o1"}, version=1),
            await tx.publish_text(down, "o1", version=3, event_id=given, headers={"x-source": "script"}),
        ]

    staged = await outbox.transaction(place)
    assert await broker.depth(down) == 0  # nothing dispatches without amqp_url

    port = free_port()
    args = (
        *("relay", "--mongo-uri", mongodb.uri, "--database", mongodb.name, "--amqp-url", broker.url),
        *("--poll-interval", "0.1", "--http-port", str(port)),
    )
    async with (
        aiohttp.ClientSession() as session,
        cli_process(*args, env=cli_env(broker.url, mongodb.uri), cwd=tmp_path) as process,
    ):
        assert await broker.wait_for_depth(down, 2, timeout=30.0) == 2

        async def ready() -> bool:
            await process.check_running()
            return await answers(session, f"http://127.0.0.1:{port}/readyz")

        await eventually(ready, what="/readyz 200", interval=0.05)

        async def metrics_show_two() -> bool:
            answer = await get(session, f"http://127.0.0.1:{port}/metrics")
            return answer is not None and "lily_outbox_published_total 2.0" in answer[1]

        await eventually(metrics_show_two, what="two records published in /metrics", interval=0.1)
        answer = await get(session, f"http://127.0.0.1:{port}/metrics")
        assert answer is not None
        # No transport failure, no alarm: the counters are there, at zero (docs/outbox.md, "Failure classes").
        assert "lily_outbox_released_total 0.0" in answer[1]
        assert "lily_outbox_blocked_seconds_total 0.0" in answer[1]
        await asyncio.sleep(0.5)  # several polls: nothing is published twice
        result = await process.stop(timeout=30)
    assert result.returncode == 0, result.describe()
    assert "relay_stop" in result.stdout
    assert "shutdown succeeded" in result.stdout
    messages = await broker.drain(down)
    assert [m.headers["x-lily-event-id"] for m in messages] == [str(e) for e in staged]  # once each, in order
    first, second = messages
    assert orjson.loads(first.body) == {"order_id": "o1"}
    assert (first.content_type, first.headers["x-lily-content-kind"]) == ("application/json", "json")
    assert first.headers["x-lily-schema-version"] == "1"
    assert (second.body, second.content_type) == (b"o1", "text/plain; charset=utf-8")
    assert (second.headers["x-lily-schema-version"], second.headers["x-source"]) == ("3", "script")
    assert "x-retry-count" not in first.headers
    for message in messages:
        validate_envelope(message.headers, len(message.body))
    records = await mongodb.db[OUTBOX].find({}).to_list()
    assert {(r["status"], r["claim_owner"].split(":")[0]) for r in records} == {("published", "lily-relay")}


async def test_the_relay_command_without_a_database_is_a_usage_error(broker: Broker, mongodb: MongoDB) -> None:
    result = await run_cli("relay", "--mongo-uri", mongodb.uri, env=cli_env(broker.url, mongodb.uri))
    assert result.returncode == 2, result.describe()
    assert "--database" in result.stderr


async def test_the_relay_command_with_a_bad_collection_name_fails_in_one_line(broker: Broker, mongodb: MongoDB) -> None:
    args = ("relay", "--mongo-uri", mongodb.uri, "--database", mongodb.name, "--collection", "a$b")
    result = await run_cli(*args, env=cli_env(broker.url, mongodb.uri))
    assert result.returncode == 2, result.describe()
    assert "OutboxOptions.collection" in one_error_line(result)


async def test_the_relay_command_with_rabbitmq_unreachable_exits_3(mongodb: MongoDB) -> None:
    url = "amqp://guest:s3cret@127.0.0.1:1/"
    args = ("relay", "--mongo-uri", mongodb.uri, "--database", mongodb.name, "--amqp-url", url)
    result = await run_cli(*args, env=cli_env(url, mongodb.uri))
    assert result.returncode == 3, result.describe()
    assert "s3cret" not in result.stderr + result.stdout
    one_error_line(result)


def test_the_relay_commands_help_documents_the_exit_status() -> None:
    with logging_restored():
        result = CliRunner().invoke(cli_app, ["relay", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.replace("│", " ").split())
    assert "Exit status: 0 success; 1 the command failed" in text
    assert "--database" in text
    assert "--http-port" in text
