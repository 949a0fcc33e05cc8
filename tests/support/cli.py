"""The ``lily-mongo`` command in a test: as a child process (docs/operations.md section 8), and in-process.

The command runs as the installed console script (or, without it, ``main()`` through
``python -c``) with ``LILY_AMQP_URL`` / ``LILY_MONGO_URI`` pointing at the test servers;
:func:`write_service` writes the service module a ``run`` test runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aio_pika.abc

from tests.support.broker import consumer_count
from tests.support.polling import eventually
from tests.support.processes import Child, Completed, run, started


def cli_argv(*args: str) -> list[str]:
    """The installed ``lily-mongo`` script next to this interpreter, else ``main()`` through ``-c``."""
    script = shutil.which("lily-mongo", path=os.path.dirname(sys.executable))
    if script is not None:
        return [script, *args]
    return [sys.executable, "-c", "from lily_mongo._cli.app import main; main()", *args]


def cli_env(amqp_url: str, mongo_uri: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        LILY_AMQP_URL=amqp_url,
        LILY_MONGO_URI=mongo_uri,
        COLUMNS="200",  # rich wraps at the terminal width; keep report and table lines whole
        NO_COLOR="1",
        PYTHONUNBUFFERED="1",
    )
    return env


async def run_cli(*args: str, env: dict[str, str], cwd: Path | None = None, timeout: float = 30.0) -> Completed:
    """The command run to its end."""
    return await run(cli_argv(*args), env=env, cwd=cwd, timeout=timeout)


@contextlib.asynccontextmanager
async def cli_process(*args: str, env: dict[str, str], cwd: Path | None = None) -> AsyncIterator[Child]:
    """A long-running command; killed and reaped if the test leaves it running."""
    async with started(cli_argv(*args), env=env, cwd=cwd) as child:
        yield child


def one_error_line(result: Completed) -> str:
    """The command's error: exactly one line on stderr, starting with ``error:``, and no traceback anywhere."""
    assert "Traceback" not in result.stderr + result.stdout, result.describe()
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.describe()
    assert lines[0].startswith("error: "), result.describe()
    return lines[0]


def run_error_line(result: Completed) -> str:
    """``run``'s error: after its banner (``starting ...``), exactly one ``error:`` line, the last, no traceback."""
    assert "Traceback" not in result.stderr + result.stdout, result.describe()
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 2, result.describe()
    assert lines[0].startswith("starting "), result.describe()
    assert lines[1].startswith("error: "), result.describe()
    return lines[-1]


async def wait_for_consumers(
    connection: aio_pika.abc.AbstractConnection, name: str, child: Child, count: int = 1, timeout: float = 20.0
) -> None:
    """Until ``count`` consumers are attached to queue ``name``; an AssertionError at once if ``child`` ends."""

    async def attached() -> bool:
        await child.check_running()
        return await consumer_count(connection, name) == count

    await eventually(attached, timeout=timeout, what=f"{count} consumer(s) on {name}", interval=0.05)


@contextlib.contextmanager
def logging_restored() -> Iterator[None]:
    """Run an in-process command (typer's CliRunner) and put the logging set-up back afterwards.

    The command configures logging for its process (one stderr handler on the root logger,
    levels, warnings captured); in a test process that would replace pytest's log capture and
    leave a handler writing to the runner's closed stream for every later test.
    """
    root = logging.getLogger()
    loggers = [root, *(logging.getLogger(name) for name in ("lily_mongo", "lily_mongo._cli.app", "aiormq", "aio_pika"))]
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in loggers]
    try:
        yield
    finally:
        for lg, handlers, level, propagate in saved:
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate = propagate
        logging.captureWarnings(False)


# -- a service module for `run` -------------------------------------------------------------------


@dataclass(frozen=True)
class EventLog:
    """The log the handler of :func:`write_service` writes: ``start <event id>``, then ``done <event id>``
    or ``cancelled <event id>``."""

    path: Path

    def lines(self) -> list[str]:
        """Its lines so far (none before it exists)."""
        return self.path.read_text().splitlines() if self.path.exists() else []

    async def wait_for(self, line: str, timeout: float = 15.0) -> None:
        async def present() -> bool:
            return line in self.lines()

        await eventually(present, timeout=timeout, what=f"{line!r} in {self.path.name}", interval=0.05)


def write_service(directory: Path, q: str, *, force_timeout: float = 5.0) -> EventLog:
    """``svcmod.consumer`` in ``directory``: one at_least_once handler on ``q`` that logs start/done
    (to the log it returns) and may sleep.

    The payload's ``sleep`` makes the handler slow; ``stubborn`` makes it ignore the first
    cancellation for 3 s (an uncooperative handler).
    """
    log = EventLog(directory / "events.log")
    source = f"""
        from __future__ import annotations

        import asyncio
        import os
        import pathlib

        from lily_mongo import Consumer, EventId, Json, RetryPolicy, queue

        QUEUE = {q!r}
        LOG = pathlib.Path({str(log.path)!r})


        def record(line: str) -> None:
            with LOG.open("a") as handle:
                handle.write(line + "\\n")


        @queue(QUEUE, version=1, content="json", guarantee="at_least_once")
        async def handle(payload: Json[dict[str, object]], event_id: EventId) -> None:
            record(f"start {{event_id}}")
            try:
                await asyncio.sleep(float(payload.get("sleep", 0)))
            except asyncio.CancelledError:
                record(f"cancelled {{event_id}}")
                if payload.get("stubborn"):
                    await asyncio.sleep(3)
                raise
            record(f"done {{event_id}}")


        consumer = Consumer(
            amqp_url=os.environ["LILY_AMQP_URL"], name="svc", graceful_timeout=20.0, force_timeout={force_timeout!r}
        )
        consumer.configure_queue(QUEUE, concurrency=1, prefetch=1, retry=RetryPolicy(max_retries=1, delays=(30.0,)))
        consumer.include(handle)
    """
    (directory / "svcmod.py").write_text(textwrap.dedent(source))
    return log
