"""``lily-mongo run --workers N`` and ``--reload``, run as real subprocesses (docs/deployment.md, section 2).

The service's handler writes its process id with every event it handles, so
the test sees which worker handled what: two workers are two processes
competing for one queue; SIGTERM to the supervisor drains both and exits 0; a
worker killed with SIGKILL is started again and consumes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import textwrap
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from tests.support.broker import Broker
from tests.support.cli import cli_argv, cli_env, wait_for_consumers
from tests.support.polling import eventually
from tests.support.probes import answers, free_port, get
from tests.support.processes import Child, started

SERVICE = """
    import asyncio
    import os
    import pathlib
    import time

    from lily_mongo import Consumer, EventId, Json, RetryPolicy, queue

    LOG = pathlib.Path({log!r})


    @queue({q!r}, version=1, content="json", guarantee="at_least_once")
    async def handle(payload: Json[dict[str, object]], event_id: EventId) -> None:
        if payload.get("block"):
            time.sleep(float(payload["block"]))  # a synchronous call: the worker's event loop stops
        await asyncio.sleep(float(payload.get("sleep", 0.05)))
        with LOG.open("a") as out:
            out.write(f"{{os.getpid()}} {{event_id}}\\n")


    consumer = Consumer(amqp_url=os.environ["LILY_AMQP_URL"], name="workersvc", graceful_timeout=20.0)
    consumer.configure_queue({q!r}, concurrency=1, prefetch=1, retry=RetryPolicy(max_retries=0, delays=()))
    consumer.include(handle)
"""


@dataclass
class Supervised:
    """The supervisor process (its output in files, read while it runs) and what the handlers logged."""

    process: Child
    log: Path

    def handled(self) -> dict[str, int]:
        """Event id -> the process id that handled it."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return {event: int(pid) for pid, event in (line.split() for line in lines)}

    def started(self) -> dict[int, list[int]]:
        """Worker index -> the process ids it was started with, in order (from the supervisor's lines)."""
        found: dict[int, list[int]] = {}
        for line in self.process.stderr().splitlines():
            match = re.search(r"^worker (\d+) started \(pid (\d+)\)", line)
            if match:
                found.setdefault(int(match[1]), []).append(int(match[2]))
        return found


@contextlib.asynccontextmanager
async def supervised(broker: Broker, tmp_path: Path, q: str, *args: str) -> AsyncIterator[Supervised]:
    log = tmp_path / "handled.log"
    (tmp_path / "workersvc.py").write_text(textwrap.dedent(SERVICE.format(q=q, log=str(log))))
    env = cli_env(broker.url, "mongodb://127.0.0.1:1/")
    argv = cli_argv("run", "workersvc:consumer", *args)
    async with started(argv, env=env, cwd=tmp_path, files=tmp_path / "supervisor") as process:
        service = Supervised(process, log)
        try:
            yield service
        finally:
            await process.reap()  # first: a dead supervisor restarts no worker
            with contextlib.suppress(ProcessLookupError):
                for pids in service.started().values():
                    for pid in pids:
                        os.kill(pid, signal.SIGKILL)  # a worker the test left running


async def consumers(broker: Broker, q: str, count: int, service: Supervised) -> None:
    await wait_for_consumers(broker.connection, q, service.process, count, timeout=30.0)


async def test_two_workers_compete_drain_on_sigterm_and_a_killed_one_is_restarted(
    broker: Broker, tmp_path: Path
) -> None:
    q = broker.queue("workers")
    async with supervised(broker, tmp_path, q, "--workers", "2") as service:
        await consumers(broker, q, 2, service)
        events = [await broker.publish(q, {"n": n}) for n in range(20)]
        await eventually(lambda: len(service.handled()) == 20, timeout=30, what="20 events handled", interval=0.1)
        first = service.started()
        pids = set(service.handled().values())
        assert pids == {first[1][0], first[2][0]}, (pids, first)  # two processes, both the workers
        assert service.process.pid not in pids

        os.kill(first[1][0], signal.SIGKILL)
        await eventually(lambda: len(service.started().get(1, [])) == 2, timeout=30, what="worker 1 restarted")
        await consumers(broker, q, 2, service)
        restarted = service.started()[1][1]
        assert restarted != first[1][0]
        more = [await broker.publish(q, {"n": n}) for n in range(20, 40)]
        await eventually(lambda: len(service.handled()) == 40, timeout=30, what="40 events handled", interval=0.1)
        assert restarted in {service.handled()[str(e)] for e in more}

        slow = await broker.publish(q, {"sleep": 2})  # in flight at SIGTERM: drained, not forced
        await asyncio.sleep(0.5)
        result = await service.process.stop(timeout=50)
    assert result.returncode == 0, result.describe()
    assert result.stdout.count("shutdown succeeded; unresolved deliveries: 0") == 2, result.stdout
    assert "[worker 1] shutdown succeeded" in result.stdout
    assert "[worker 2] shutdown succeeded" in result.stdout
    assert "exited with status -9; restarting it in" in result.stderr
    assert "workers stopped: 1: exit 0, 2: exit 0" in result.stderr
    assert str(slow) in service.handled()
    assert {str(e) for e in events + more} <= set(service.handled())
    assert await broker.wait_for_depth(q, 0) == 0


async def test_workers_serve_readiness_and_metrics_for_all_of_them(broker: Broker, tmp_path: Path) -> None:
    q = broker.queue("workershttp")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ("--workers", "2", "--http-port", str(port))
    async with supervised(broker, tmp_path, q, *args) as service, aiohttp.ClientSession() as session:
        await eventually(lambda: answers(session, f"{base}/healthz"), timeout=30, what="the probes", interval=0.1)
        await consumers(broker, q, 2, service)

        def ready() -> Awaitable[bool]:
            return answers(session, f"{base}/readyz")

        await eventually(ready, timeout=20, what="/readyz 200 with both workers", interval=0.1)
        await broker.publish(q, {"n": 1})
        await eventually(lambda: len(service.handled()) == 1, timeout=20, what="one event handled", interval=0.1)

        async def counted() -> bool:
            answer = await get(session, f"{base}/metrics")
            return answer is not None and 'outcome="acked"' in answer[1]

        await eventually(counted, timeout=10, what="the acked delivery in /metrics", interval=0.1)
        answer = await get(session, f"{base}/metrics")
        assert answer is not None
        text = answer[1]
        assert "lily_workers 2.0" in text
        assert 'lily_ready{worker="1"} 1.0' in text
        assert 'lily_ready{worker="2"} 1.0' in text
        acked = re.findall(rf'lily_deliveries_total{{outcome="acked",queue="{q}",worker="(\d)"}} (\S+)', text)
        assert sum(float(value) for _, value in acked) == 1.0, text

        worker = service.started()[2][0]
        os.kill(worker, signal.SIGSTOP)  # a worker that stops answering: not ready
        try:
            answer = await get(session, f"{base}/readyz")
            assert answer is not None
            assert answer[0] == 503, answer
            assert "worker 2" in answer[1]
        finally:
            os.kill(worker, signal.SIGCONT)
        await eventually(ready, timeout=20, what="/readyz 200 again", interval=0.1)
        result = await service.process.stop(timeout=50)
    assert result.returncode == 0, result.describe()


async def test_reload_restarts_the_worker_gracefully_when_a_source_file_changes(broker: Broker, tmp_path: Path) -> None:
    q = broker.queue("reload")
    async with supervised(broker, tmp_path, q, "--reload") as service:
        await consumers(broker, q, 1, service)
        (first,) = service.started()[1]
        await asyncio.sleep(0.5)  # the watcher is up
        source = tmp_path / "workersvc.py"
        source.write_text(source.read_text() + "\n# changed\n")
        await eventually(lambda: len(service.started()[1]) == 2, timeout=30, what="the worker restarted")
        await consumers(broker, q, 1, service)
        second = service.started()[1][1]
        assert second != first
        event = await broker.publish(q, {"n": 1})
        await eventually(lambda: str(event) in service.handled(), timeout=20, what="the event", interval=0.1)
        assert service.handled()[str(event)] == second
        result = await service.process.stop(timeout=50)
    assert result.returncode == 0, result.describe()
    assert "changed: workersvc.py; restarting the workers gracefully" in result.stderr
    # The first worker shut down gracefully too (its report), then the second.
    assert result.stdout.count("shutdown succeeded; unresolved deliveries: 0") == 2, result.stdout


async def test_with_reload_a_worker_that_cannot_load_waits_for_the_fix(broker: Broker, tmp_path: Path) -> None:
    q = broker.queue("reload-broken")
    async with supervised(broker, tmp_path, q, "--reload") as service:
        await consumers(broker, q, 1, service)
        await asyncio.sleep(0.5)  # the watcher is up
        source = tmp_path / "workersvc.py"
        good = source.read_text()
        source.write_text(good + "\noops(\n")  # a syntax error: the restarted worker exits 2
        await eventually(
            lambda: "restarts at the next change" in service.process.stderr(),
            timeout=30,
            what="the broken worker waiting",
        )
        assert service.process.returncode is None  # the supervisor did not give up
        source.write_text(good + "\n# fixed\n")
        await eventually(lambda: len(service.started()[1]) == 3, timeout=30, what="the worker started again")
        await consumers(broker, q, 1, service)
        event = await broker.publish(q, {"n": 1})
        await eventually(lambda: str(event) in service.handled(), timeout=20, what="the event", interval=0.1)
        result = await service.process.stop(timeout=50)
    assert result.returncode == 0, result.describe()


async def test_a_forced_shutdown_kills_a_worker_whose_event_loop_is_blocked(broker: Broker, tmp_path: Path) -> None:
    q = broker.queue("blocked")
    async with supervised(broker, tmp_path, q, "--workers", "2") as service:
        await consumers(broker, q, 2, service)
        await broker.publish(q, {"block": 120})
        await asyncio.sleep(1.0)  # a worker took it and its event loop stopped
        service.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(1.5)
        result = await service.process.stop(timeout=30)  # forces; the blocked worker cannot act on it
    assert result.returncode != 0, result.describe()
    killing = r"worker \d \(pid \d+\) did not end 10 s after the forced shutdown: killing it"
    assert re.search(killing, result.stderr), result.describe()
