"""Child processes a test starts: watched while they run, stopped by a signal, never left running.

Every process test goes one way: :func:`started` starts the process (its output to pipes, or
to files the test reads while it runs) and, on the way out, kills and reaps whatever the test
left running; :meth:`Child.stop` sends the signal a test stops it with and waits, bounded, for
its exit status and output; :meth:`Child.kill` is the crash. :class:`Workers` are worker scripts
that report by JSON lines on stdout, started by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tests.support.polling import eventually

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Completed:
    """An ended process: its exit status and all it wrote."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return f"{self.argv[1:]} exited {self.returncode}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"


class Child:
    """A process a test started (by :func:`started`).

    Its output goes to pipes, read once it ends (:meth:`read_line` reads one line meanwhile),
    or, with ``files``, to ``<files>.out`` and ``<files>.err``,
    which :meth:`stdout` and :meth:`stderr` read while it runs. With ``group`` it leads a
    process group of its own and every signal goes to the whole group, as a terminal sends it.
    """

    def __init__(
        self, process: asyncio.subprocess.Process, argv: list[str], *, files: Path | None, group: bool
    ) -> None:
        self.process = process
        self.argv = argv
        self.files = files
        self.group = group

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def stdout(self) -> str:
        """What it wrote on stdout so far (with ``files``)."""
        return self._read(".out")

    def stderr(self) -> str:
        """What it wrote on stderr so far (with ``files``)."""
        return self._read(".err")

    def _read(self, suffix: str) -> str:
        assert self.files is not None, "the output goes to pipes: read them, or wait for the end"
        path = self.files.with_name(self.files.name + suffix)
        return path.read_text(errors="replace") if path.exists() else ""

    async def read_line(self, timeout: float, *, stderr: bool = False) -> str:
        """The next line it writes on its stdout pipe (``stderr``: its stderr pipe), waiting up to ``timeout`` s."""
        stream = self.process.stderr if stderr else self.process.stdout
        assert stream is not None, "the output goes to files: read them"
        return (await asyncio.wait_for(stream.readline(), timeout)).decode(errors="replace")

    def send_signal(self, number: int) -> None:
        """Send signal ``number`` (to its group, with ``group``)."""
        if self.group:
            os.killpg(self.pid, number)
        else:
            self.process.send_signal(number)

    async def stop(self, timeout: float, number: int = signal.SIGTERM) -> Completed:
        """Send signal ``number`` (SIGTERM unless told), then :meth:`finish`."""
        self.send_signal(number)
        return await self.finish(timeout)

    async def finish(self, timeout: float) -> Completed:
        """Its exit status and all it wrote, once it ends; killed, and an AssertionError, if it outlives ``timeout``."""
        try:
            stdout, stderr = await asyncio.wait_for(self._collect(), timeout)
        except TimeoutError:
            self.send_signal(signal.SIGKILL)
            stdout, stderr = await self._collect()
            raise AssertionError(
                f"{self.argv[1:]} did not exit within {timeout} s\nstdout:\n{stdout}\nstderr:\n{stderr}"
            ) from None
        assert self.process.returncode is not None
        return Completed(self.argv, self.process.returncode, stdout, stderr)

    async def kill(self) -> None:
        """SIGKILL, the crash: it must die of it."""
        self.send_signal(signal.SIGKILL)
        assert await self.process.wait() == -signal.SIGKILL

    async def check_running(self) -> None:
        """An AssertionError with all it wrote if it has ended (a wait for it to do something is over then)."""
        if self.process.returncode is not None:
            ended = await self.finish(timeout=10.0)
            raise AssertionError(f"the process ended before its time: {ended.describe()}")

    async def _collect(self) -> tuple[str, str]:
        if self.files is not None:
            await self.process.wait()
            return self.stdout(), self.stderr()
        stdout, stderr = await self.process.communicate()
        return stdout.decode(errors="replace"), stderr.decode(errors="replace")

    async def reap(self) -> None:
        """Kill it if it still runs (its group, with ``group``), and wait for its end."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.send_signal(signal.SIGKILL)
        await self._collect()


@contextlib.asynccontextmanager
async def started(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    files: Path | None = None,
    group: bool = False,
) -> AsyncIterator[Child]:
    """``argv`` as a child process (stdin empty; output to pipes, or to ``files``: see :class:`Child`),
    killed and reaped on the way out if the test left it running."""
    outputs: list[IO[bytes]] = []
    if files is not None:
        outputs = [files.with_name(files.name + suffix).open("wb") for suffix in (".out", ".err")]
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            cwd=cwd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=outputs[0] if outputs else asyncio.subprocess.PIPE,
            stderr=outputs[1] if outputs else asyncio.subprocess.PIPE,
            start_new_session=group,
        )
    finally:
        for output in outputs:
            output.close()
    child = Child(process, list(argv), files=files, group=group)
    try:
        yield child
    finally:
        await child.reap()


async def run(
    argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 30.0
) -> Completed:
    """``argv`` run to its end (bounded by ``timeout``)."""
    async with started(argv, env=env, cwd=cwd) as child:
        return await child.finish(timeout)


# -- worker scripts -------------------------------------------------------------------------------


class Workers:
    """Processes of one worker script, started by name, each reporting by JSON lines on stdout.

    A worker runs ``script`` with this interpreter and ``--name <name>`` after its arguments;
    its first line is a ``ready`` record. Whatever still runs at the end is killed.
    """

    def __init__(self, directory: Path, script: Path, stack: contextlib.AsyncExitStack) -> None:
        self.directory = directory
        self.script = script
        self.children: dict[str, Child] = {}
        self._stack = stack

    async def start(self, name: str, *args: str) -> Child:
        """Start worker ``name`` and wait for its ``ready`` record."""
        argv = [sys.executable, str(self.script), *args, "--name", name]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.children[name] = await self._stack.enter_async_context(started(argv, env=env, files=self.directory / name))
        await self.wait_for_record(name, "ready", timeout=20.0)
        return self.children[name]

    async def serve_until(
        self, name: str, *args: str, done: Callable[[], Awaitable[bool]], what: str, timeout: float, stop: float = 15.0
    ) -> Child:
        """Start worker ``name``, wait up to ``timeout`` s until ``done`` holds (it must keep running
        meanwhile), then stop it with SIGTERM: it must exit 0 within ``stop`` s."""
        child = await self.start(name, *args)

        async def held() -> bool:
            await child.check_running()
            return await done()

        await eventually(held, what=what, timeout=timeout, interval=0.05)
        ended = await child.stop(timeout=stop)
        assert ended.returncode == 0, ended.describe()
        return child

    def records(self, name: str) -> list[dict[str, Any]]:
        """The complete JSON lines worker ``name`` wrote so far."""
        text = self.children[name].stdout()
        return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]

    async def wait_for_record(self, name: str, key: str, timeout: float = 10.0) -> dict[str, Any]:
        """The first record of worker ``name`` that holds ``key``, waiting up to ``timeout`` s for it."""
        child = self.children[name]
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            for record in self.records(name):
                if key in record:
                    return record
            await child.check_running()
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"worker {name} wrote no {key!r} record in {timeout} s: {child.stderr()[-2000:]}")
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def worker_processes(script: Path, directory: Path) -> AsyncIterator[Workers]:
    """The workers of ``script`` one test starts (their output files in ``directory``), none left running."""
    async with contextlib.AsyncExitStack() as stack:
        yield Workers(directory, script, stack)
