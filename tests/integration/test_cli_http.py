"""``lily-mongo run --http-port``: health, readiness and Prometheus metrics, run as a real subprocess.

The service module's consumer starts slowly (a ``Consumer`` subclass sleeps
before starting) and its handler sleeps, so the test can see ``/readyz`` answer
503 while the consumer starts, 200 while it runs, and 503 again while it drains
after SIGTERM; ``/healthz`` answers 200 throughout.
"""

from __future__ import annotations

import json
import signal
import socket
import textwrap
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.support.broker import Broker
from tests.support.cli import cli_env, cli_process
from tests.support.polling import eventually
from tests.support.probes import free_port, get


def write_slow_service(directory: Path, q: str) -> None:
    """``slowsvc.consumer``: starts after ``START_DELAY`` s; its handler sleeps ``payload["sleep"]`` s."""
    source = f"""
        from __future__ import annotations

        import asyncio
        import os

        from lily_mongo import Consumer, Json, RetryPolicy, queue

        QUEUE = {q!r}


        class SlowStart(Consumer):
            async def start(self):
                await asyncio.sleep(1.5)
                return await super().start()


        @queue(QUEUE, version=1, content="json", guarantee="at_least_once")
        async def handle(payload: Json[dict[str, object]]) -> None:
            await asyncio.sleep(float(payload.get("sleep", 0)))


        consumer = SlowStart(amqp_url=os.environ["LILY_AMQP_URL"], name="slowsvc", graceful_timeout=20.0)
        consumer.configure_queue(QUEUE, concurrency=1, prefetch=1, retry=RetryPolicy(max_retries=0, delays=()))
        consumer.include(handle)
    """
    (directory / "slowsvc.py").write_text(textwrap.dedent(source))


async def test_run_serves_readiness_health_and_metrics_across_start_and_shutdown(
    broker: Broker, mongo_uri: str, tmp_path: Path
) -> None:
    q = broker.queue("http")
    write_slow_service(tmp_path, q)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = cli_env(broker.url, mongo_uri)
    args = ("run", "slowsvc:consumer", "--http-port", str(port), "--log-level", "debug", "--log-format", "json")
    statuses: list[int] = []
    async with aiohttp.ClientSession() as session, cli_process(*args, env=env, cwd=tmp_path) as process:

        async def ready_is(code: int) -> bool:
            await process.check_running()
            answer = await get(session, f"{base}/readyz")
            if answer is not None and (not statuses or statuses[-1] != answer[0]):
                statuses.append(answer[0])
            return answer is not None and answer[0] == code

        await eventually(lambda: ready_is(503), timeout=20, what="/readyz 503 while starting", interval=0.05)
        assert await get(session, f"{base}/healthz") == (200, "ok\n")
        await eventually(lambda: ready_is(200), timeout=20, what="/readyz 200 once running", interval=0.05)

        await broker.publish(q, {"sleep": 0})
        await broker.publish(q, {"sleep": 3})

        async def metrics_show_one_acked() -> bool:
            answer = await get(session, f"{base}/metrics")
            assert answer is not None
            return f'lily_deliveries_total{{outcome="acked",queue="{q}"}} 1.0' in answer[1]

        await eventually(metrics_show_one_acked, timeout=15, what="one acked delivery in /metrics", interval=0.1)
        answer = await get(session, f"{base}/metrics")
        assert answer is not None
        status, text = answer
        assert status == 200
        assert "# HELP lily_deliveries_total" in text
        assert "# TYPE lily_deliveries_total counter" in text
        families = {family.name: family for family in text_string_to_metric_families(text)}
        assert {"lily_ready", "lily_deliveries", "messaging_client_consumed_messages", "lily_permits"} <= set(families)
        in_flight = {s.labels["queue"]: s.value for s in families["lily_deliveries_in_flight"].samples}
        assert in_flight == {q: 1.0}  # the slow delivery
        durations = [s for s in families["messaging_process_duration_seconds"].samples if s.name.endswith("_count")]
        assert [(s.labels, s.value) for s in durations] == [({"queue": q, "outcome": "acked"}, 1.0)]

        process.send_signal(signal.SIGTERM)  # drains the slow delivery for about 3 s
        await eventually(lambda: ready_is(503), timeout=5, what="/readyz 503 while draining", interval=0.05)
        assert await get(session, f"{base}/healthz") == (200, "ok\n")
        result = await process.finish(timeout=30)
    assert result.returncode == 0, result.describe()
    assert statuses[:3] == [503, 200, 503], statuses
    # JSON log lines: one per delivery at DEBUG, naming queue, handler, event id and outcome.
    lines = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    deliveries = [line for line in lines if line.get("outcome") == "acked"]
    assert len(deliveries) == 2, result.describe()
    assert all(line["queue"] == q and line["handler"] and line["event_id"] for line in deliveries)
    steps = [line["step"] for line in lines if "step" in line]
    assert steps[:2] == ["stop_intake", "drain"], steps
    assert "guest:guest" not in result.stderr


async def test_run_http_port_in_use_fails_clearly(broker: Broker, mongo_uri: str, tmp_path: Path) -> None:
    q = broker.queue("busy")
    write_slow_service(tmp_path, q)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        async with cli_process(
            "run", "slowsvc:consumer", "--http-port", str(port), env=cli_env(broker.url, mongo_uri), cwd=tmp_path
        ) as process:
            result = await process.finish(timeout=20)
    assert result.returncode == 2, result.describe()
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


async def test_run_rejects_an_unknown_log_format(amqp: str, mongo_uri: str, tmp_path: Path) -> None:
    async with cli_process("run", "x:y", "--log-format", "xml", env=cli_env(amqp, mongo_uri), cwd=tmp_path) as process:
        result = await process.finish(timeout=20)
    assert result.returncode == 2, result.describe()
    assert "--log-format" in result.stderr
