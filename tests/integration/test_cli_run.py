"""``lily-mongo run`` as an operator meets it: under ``uv run``, with signals, with MongoDB away, with JSON logs.

Each test runs the command as a real subprocess and states what an operator
expects: one Ctrl-C (a SIGINT to the whole process group, as a terminal sends
it: ``uv run`` then forwards its own copy) drains gracefully and exits 0; a
second signal over a second later forces; a closed MongoDB port ends the start
within 15 s in one line; every stderr line of a JSON run parses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import signal
import socket
import textwrap
import time
import urllib.parse
from pathlib import Path

import aio_pika
import pytest

from lily_mongo._inbox.protocol import COMPLETED
from tests.support.broker import Broker
from tests.support.cli import (
    cli_env,
    cli_process,
    one_error_line,
    run_cli,
    run_error_line,
    wait_for_consumers,
    write_service,
)
from tests.support.mongo import MongoDB
from tests.support.processes import Child, started

REPO = Path(__file__).resolve().parents[2]
UV = shutil.which("uv")


@pytest.fixture
def env(amqp: str, mongo_uri: str) -> dict[str, str]:
    """The command's environment, pointing at the test servers."""
    return cli_env(amqp, mongo_uri)


def uv_run(*args: str, env: dict[str, str], cwd: Path) -> contextlib.AbstractAsyncContextManager[Child]:
    """``uv run --locked --no-sync lily-mongo ...`` from the repository, in a process group of its own
    (its signals go to the group, as a terminal sends them)."""
    assert UV is not None
    argv = [UV, "run", "--project", str(REPO), "--locked", "--no-sync", "lily-mongo", *args]
    return started(argv, env=env, cwd=cwd, group=True)


@pytest.mark.skipif(UV is None, reason="uv is not installed")
@pytest.mark.parametrize("signals", [1, 2], ids=["one-ctrl-c", "two-signals-1.5s-apart"])
async def test_ctrl_c_under_uv_run_drains_gracefully_and_a_second_one_forces(
    env: dict[str, str], broker: Broker, tmp_path: Path, signals: int
) -> None:
    q = broker.queue("uvrun")
    log = write_service(tmp_path, q)
    async with uv_run("run", "svcmod:consumer", env=env, cwd=tmp_path) as process:
        await wait_for_consumers(broker.connection, q, process, timeout=60)
        event = await broker.publish(q, {"sleep": 3 if signals == 1 else 60})
        await log.wait_for(f"start {event}")
        # What a terminal's Ctrl-C does: SIGINT to the whole foreground group, uv's.
        if signals == 2:
            process.send_signal(signal.SIGINT)
            await asyncio.sleep(1.5)
        result = await process.stop(timeout=40, number=signal.SIGINT)
    if signals == 1:
        assert result.returncode == 0, result.describe()
        assert result.stdout.startswith("shutdown succeeded; unresolved deliveries: 0"), result.describe()
        assert log.lines() == [f"start {event}", f"done {event}"]  # drained: the handler finished
        assert await broker.wait_for_depth(q, 0) == 0
        assert "shutting down gracefully (up to 20 s); press Ctrl-C again to force" in result.stderr
    else:
        # lily-mongo exits 1 after a forced shutdown; uv, which took the second Ctrl-C too, passes on
        # a non-zero status as 130 (the interrupted status) whatever the child's own.
        assert result.returncode in (1, 130), result.describe()
        assert result.stdout.startswith("shutdown FORCED; unresolved deliveries: 0"), result.describe()
        assert "succeeded" not in result.stdout
        assert f"cancelled {event}" in log.lines()
        assert await broker.wait_for_depth(q, 1) == 1  # requeued by the force, not lost
        assert "received again: forcing the shutdown" in result.stderr


def mongo_service(directory: Path, q: str, uri: str, *, check_timeout: float | None = None) -> None:
    """``mongosvc.consumer``: an inbox handler on ``q`` with a client of ``uri``."""
    timeout = "" if check_timeout is None else f", mongo_check_timeout={check_timeout!r}"
    source = f"""
        import os
        from pymongo import AsyncMongoClient
        from lily_mongo import Consumer, Json, MongoScope, queue

        @queue({q!r}, version=1, content="json")
        async def handle(body: Json[dict[str, object]], mongo: MongoScope) -> None:
            await mongo.database["effects"].insert_one({{"body": body}}, session=mongo.session)

        consumer = Consumer(amqp_url=os.environ["LILY_AMQP_URL"], name="mongosvc",
                            mongo_client=AsyncMongoClient({uri!r}), database="shop"{timeout})
        consumer.include(handle)
    """
    (directory / "mongosvc.py").write_text(textwrap.dedent(source))


async def test_a_closed_mongodb_port_ends_the_start_within_15_s_in_one_line(
    env: dict[str, str], broker: Broker, tmp_path: Path
) -> None:
    secret = "S3cr3t-p@ss"
    mongo_service(tmp_path, broker.queue("nomongo"), f"mongodb://app:{urllib.parse.quote_plus(secret)}@127.0.0.1:1/")
    started = time.monotonic()
    result = await run_cli("run", "mongosvc:consumer", env=env, cwd=tmp_path, timeout=30)
    assert time.monotonic() - started < 15, result.describe()
    assert result.returncode == 3, result.describe()
    line = run_error_line(result)  # the banner first, then the one error line
    assert line.startswith("error: MongoDB is not reachable at mongodb://127.0.0.1:1/ (connection refused); "), line
    assert "is it running?" in line
    assert "Check the consumer's amqp_url" not in line  # RabbitMQ's advice is not MongoDB's
    assert secret not in result.stdout + result.stderr
    assert urllib.parse.quote_plus(secret) not in result.stdout + result.stderr


async def test_a_signal_during_the_start_stops_it_in_one_line(
    env: dict[str, str], broker: Broker, tmp_path: Path
) -> None:
    mongo_service(tmp_path, broker.queue("slowstart"), "mongodb://127.0.0.1:1/", check_timeout=60.0)
    async with cli_process("run", "mongosvc:consumer", env=env, cwd=tmp_path) as process:
        banner = await process.read_line(timeout=20, stderr=True)
        assert banner.startswith("starting mongosvc"), banner
        started = time.monotonic()
        result = await process.stop(timeout=20, number=signal.SIGINT)
    assert time.monotonic() - started < 10
    assert result.returncode == 130, result.describe()
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1] == "stopped while starting: nothing was left running", result.describe()
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


async def test_the_version_and_a_usage_error(env: dict[str, str], tmp_path: Path) -> None:
    from importlib.metadata import version

    shown = await run_cli("--version", env=env, cwd=tmp_path)
    assert shown.returncode == 0, shown.describe()
    assert shown.stdout == f"lily-mongo {version('lily-mongo')}\n"
    unknown = await run_cli("run", "svc:consumer", "--no-such-option", env=env, cwd=tmp_path)
    assert unknown.returncode == 2, unknown.describe()
    assert one_error_line(unknown) == "error: No such option: --no-such-option (see lily-mongo run --help)"
    assert unknown.stdout == ""
    out_of_range = await run_cli("run", "svc:consumer", "--workers", "0", env=env, cwd=tmp_path)
    assert out_of_range.returncode == 2, out_of_range.describe()
    assert "--workers" in one_error_line(out_of_range)


JSON_SERVICE = """
    import os
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from lily_mongo import Consumer, Json, QueueHandlerError, RetryPolicy, queue

    trace.set_tracer_provider(TracerProvider())  # spans recorded (nowhere exported): their ids are in the logs

    @queue({q!r}, version=1, content="json", guarantee="at_least_once")
    async def handle(body: Json[dict[str, object]]) -> None:
        if body.get("reject"):
            raise QueueHandlerError.permanent("ITEM_REJECTED", "no")

    consumer = Consumer(amqp_url=os.environ["LILY_AMQP_URL"], name="jsonsvc", graceful_timeout=10.0)
    consumer.configure_queue({q!r}, retry=RetryPolicy(max_retries=0, delays=()))
    consumer.include(handle)
"""


async def test_every_stderr_line_of_a_json_run_is_one_json_object(
    env: dict[str, str], broker: Broker, tmp_path: Path
) -> None:
    q = broker.queue("jsonlog")
    (tmp_path / "jsonsvc.py").write_text(textwrap.dedent(JSON_SERVICE.format(q=q)))
    args = ("run", "jsonsvc:consumer", "--log-format", "json", "--log-level", "debug")
    async with cli_process(*args, env=env, cwd=tmp_path) as process:
        await wait_for_consumers(broker.connection, q, process)
        acked = await broker.publish(q, {"n": 1})
        rejected = await broker.publish(q, {"reject": True})
        assert await broker.wait_for_depth(f"{q}.dlq", 1) == 1
        result = await process.stop(timeout=30)
    assert result.returncode == 0, result.describe()
    assert result.stdout == ""  # the report is a JSON line on stderr too
    lines = [json.loads(line) for line in result.stderr.splitlines()]  # raises on any line that is not JSON
    messages = [line["message"] for line in lines]
    assert messages[0].startswith("starting jsonsvc (1 queue): RabbitMQ amqp://guest:***@"), messages
    assert any(m.startswith("running jsonsvc") for m in messages)
    assert any(m.startswith("SIGTERM received: shutting down gracefully") for m in messages)
    deliveries = {line["event_id"]: line for line in lines if "outcome" in line}
    ok, dead = deliveries[str(acked)], deliveries[str(rejected)]
    assert (ok["level"], ok["outcome"], ok["queue"]) == ("debug", "acked", q)
    assert "code" not in ok
    assert "code=None" not in ok["message"]
    assert (dead["level"], dead["outcome"], dead["code"]) == ("warning", "dead_lettered", "ITEM_REJECTED")
    for line in (ok, dead):
        assert line["handler"]
        assert isinstance(line["duration_ms"], float)
        assert re.fullmatch(r"[0-9a-f]{32}", line["trace_id"])
        assert re.fullmatch(r"[0-9a-f]{16}", line["span_id"])
    assert ok["trace_id"] != dead["trace_id"]
    (report,) = [line for line in lines if "report" in line]
    assert report["message"] == "shutdown succeeded; unresolved deliveries: 0"
    assert report["report"]["graceful"] is True
    assert [a["name"] for a in report["report"]["actions"]][:2] == ["stop_intake", "drain"]
    assert "guest:guest" not in result.stderr


async def test_inbox_stats_of_a_database_without_lily_collections_exits_2(
    env: dict[str, str], mongodb: MongoDB
) -> None:
    result = await run_cli("inbox", "stats", "lily_no_such_db_here", "--mongo-uri", mongodb.uri, env=env)
    assert result.returncode == 2, result.describe()
    line = one_error_line(result)
    assert "database 'lily_no_such_db_here' has neither a 'lily_inbox' nor a 'lily_outbox' collection" in line


async def test_the_http_port_error_names_the_reason(env: dict[str, str], broker: Broker, tmp_path: Path) -> None:
    write_service(tmp_path, broker.queue("bind"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = await run_cli("run", "svcmod:consumer", "--http-port", str(port), env=env, cwd=tmp_path)
    assert result.returncode == 2, result.describe()
    assert run_error_line(result) == (
        f"error: cannot listen on 127.0.0.1:{port}: address already in use (another process listens there: "
        "choose another port)"
    )


async def test_the_tables_are_readable_at_80_columns(env: dict[str, str], broker: Broker, mongodb: MongoDB) -> None:
    narrow = {**env, "COLUMNS": "80"}
    handler = "orders.created/v1/json/on_order_created_with_a_rather_long_name"
    await mongodb.db["lily_inbox"].insert_one({"_id": f"{handler}|e1", "handler": handler, "state": COMPLETED})
    stats = await run_cli("inbox", "stats", mongodb.name, "--mongo-uri", mongodb.uri, env=narrow)
    assert stats.returncode == 0, stats.describe()
    assert all(len(line) <= 80 for line in stats.stdout.splitlines()), stats.stdout
    assert "outbox_published=0" in stats.stdout  # too narrow for the table: a block per handler
    assert handler in stats.stdout.splitlines()  # the id whole, on a line of its own

    q = broker.queue("narrow")
    await broker.channel.declare_queue(f"{q}.dlq", durable=True)
    reason = "the payment gateway answered 503 three times in a row and the order could not be confirmed"
    headers: aio_pika.abc.HeadersType = {
        "x-lily-event-id": "0f8fad5b-d9cb-469f-a165-70867728950e",
        "x-lily-failure-code": "PAYMENT_DOWN",
        "x-lily-failure-reason": reason,
        "x-lily-failed-queue": q,
    }
    await broker.channel.default_exchange.publish(aio_pika.Message(b"{}", headers=headers), routing_key=f"{q}.dlq")
    assert await broker.wait_for_depth(f"{q}.dlq", 1) == 1
    listed = await run_cli("dlq", "list", q, env=narrow)
    assert listed.returncode == 0, listed.describe()
    assert all(len(line) <= 80 for line in listed.stdout.splitlines()), listed.stdout
    assert "0f8fad5b-d9cb-469f-a165-70867728950e  library  PAYMENT_DOWN" in listed.stdout
    assert reason in " ".join(listed.stdout.split())  # whole, wrapped at the terminal's width
    wide = await run_cli("dlq", "list", q, "--wide", env=narrow)
    assert "┃ event id" in wide.stdout, wide.describe()
