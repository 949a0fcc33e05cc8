"""``lily-mongo run --workers N`` and ``--reload``: worker processes of one target, supervised.

Each worker is a ``lily-mongo run TARGET`` process of its own (its own
connections, competing for the same queues: RabbitMQ hands each delivery to one
of them, and the inbox's leases coordinate them as they coordinate replicas on
several machines). The supervisor starts them, forwards SIGTERM/SIGINT with the
one signal policy (``_signals``: the first stops every worker gracefully, one
at least a second later forces them), restarts a worker that dies (with
backoff, at most :data:`MAX_RESTARTS` times in a row; a worker exiting with the
usage status is not restarted: its target or plan is wrong), and exits 0 only
when every worker shut down gracefully. With ``--reload`` it restarts the
workers gracefully whenever a ``.py`` file under the current directory changes
(watchfiles).

Each worker holds one end of a socket pair (``--worker-fd``): it reports its
probe port and that it runs; when the supervisor's end closes (the supervisor
died), the worker shuts down gracefully. With ``--http-port`` the supervisor
serves the probes for all workers (``_http.WorkerProbes``): each worker
listens on a free loopback port of its own, and the supervisor asks each one
(docs/deployment.md, section 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import signal
import socket
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._backoff import backoff
from .._errors import ConfigError
from .._signals import ShutdownSignals
from .._tasks import TaskSet
from .._text import bind_reason
from .exit_codes import ExitCode
from .logs import COMMAND_LOGGER

if TYPE_CHECKING:
    from .probes import WorkerProbes

__all__ = ["MAX_RESTARTS", "WorkerOptions", "exit_status", "restart_delay", "supervise"]

say = logging.getLogger(COMMAND_LOGGER)

MAX_RESTARTS = 5
KILL_AFTER = 10.0  # seconds from a forced shutdown to killing a worker that has not ended
"""Restarts of one worker in a row (deaths without a stable run between them) before the supervisor gives up."""
STABLE_AFTER = 30.0
"""A worker that ran this many seconds before dying starts a new row of restarts."""
_RESTART_BASE, _RESTART_CAP = 0.5, 30.0


@dataclass(frozen=True, kw_only=True)
class WorkerOptions:
    """What ``run`` was given: the target and the options each worker runs with."""

    target: str
    workers: int
    reload: bool
    http: tuple[str, int] | None
    log_level: str
    log_format: str
    debug: bool


# A worker the signal reached before it could handle one (still importing): stopped while starting too.
# A worker stopped while it started (by a signal, or reporting it).
_STOPPED_EARLY = frozenset({ExitCode.INTERRUPTED, -signal.SIGTERM, -signal.SIGINT})


def exit_status(finals: list[int | None]) -> int:
    """The supervisor's exit status from each worker's last one (None: it was not running at the end).

    0 when every worker shut down gracefully; 130 when the others did and some were stopped
    while they started (nothing of theirs was left running); 1 otherwise.
    """
    if all(code == 0 for code in finals):
        return 0
    if all(code == 0 or code in _STOPPED_EARLY for code in finals):
        return ExitCode.INTERRUPTED
    return ExitCode.FAILED


def restart_delay(failures: int, *, jitter: float) -> float | None:
    """Seconds to wait before restarting a worker that died for the ``failures``-th time in a row
    (1 for the first), or None: give up. Doubles from 0.5 s up to 30 s (the one backoff rule)."""
    if failures > MAX_RESTARTS:
        return None
    return backoff(failures - 1, base=_RESTART_BASE, cap=_RESTART_CAP, jitter=jitter)


@dataclass(eq=False)
class Worker:
    """One worker process, as the supervisor sees it."""

    index: int
    process: asyncio.subprocess.Process
    started: float
    http_port: int | None = None
    running: bool = False
    restart: bool = False  # stopped by the supervisor to be started again (--reload)
    link: socket.socket | None = field(default=None, repr=False)

    @property
    def alive(self) -> bool:
        return self.process.returncode is None


class Supervisor:
    """Starts, watches, restarts and stops the workers; :meth:`run` returns the exit status."""

    def __init__(self, options: WorkerOptions) -> None:
        self.options = options
        self.workers: dict[int, Worker] = {}
        self.restarts = 0
        self._stopping = asyncio.Event()
        self._changed = asyncio.Event()
        self._final: dict[int, int] = {}
        self._gave_up: int | None = None
        self._tasks = TaskSet()  # each worker's listener
        self._killer: asyncio.Future[None] | None = None  # after a forced shutdown

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def failed(self) -> bool:
        """True once the supervisor gave up on a worker."""
        return self._gave_up is not None

    async def run(self) -> int:
        options = self.options
        count = options.workers
        signals = ShutdownSignals(
            self.stop, self.force, notice=f"stopping {count} worker(s) gracefully; press Ctrl-C again to force"
        )
        uninstall = signals.install()
        probes = None
        try:
            if options.http is not None:
                probes = await self._start_probes(*options.http)
            say.info(
                "running %s in %d worker process(es)%s; Ctrl-C or SIGTERM stops them gracefully",
                options.target,
                count,
                ", restarting them when a .py file changes" if options.reload else "",
            )
            keepers = [asyncio.ensure_future(self._keep(index)) for index in range(1, count + 1)]
            watcher = asyncio.ensure_future(self._watch()) if options.reload else None
            try:
                await asyncio.gather(*keepers)
            finally:
                for task in (*keepers, watcher):
                    if task is not None and not task.done():
                        task.cancel()
                await asyncio.gather(*keepers, *([watcher] if watcher else []), return_exceptions=True)
                await self._reap()
                for task in self._tasks.pending():
                    task.cancel()
                await self._tasks.join(self._tasks.pending(), 5.0)
        finally:
            uninstall()
            if self._killer is not None:
                self._killer.cancel()
            if probes is not None:
                await probes.stop()
        if self._gave_up is not None:
            return self._gave_up
        finals = [self._final.get(index) for index in range(1, count + 1)]
        say.log(
            logging.INFO if all(code == 0 for code in finals) else logging.WARNING,
            "workers stopped: %s",
            ", ".join(f"{index}: exit {'?' if code is None else code}" for index, code in enumerate(finals, 1)),
        )
        return exit_status(finals)

    # -- signals ------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every worker gracefully (SIGTERM each)."""
        self._stopping.set()
        self._signal_all()

    def force(self) -> None:
        """Force every worker: a second SIGTERM, at least a second after the first (the same policy); one
        that has not ended :data:`KILL_AFTER` seconds later (its event loop blocked) is killed."""
        self._stopping.set()
        self._signal_all()
        if self._killer is None:
            self._killer = asyncio.ensure_future(self._kill_after(KILL_AFTER))

    async def _kill_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        for worker in self.workers.values():
            if worker.alive:
                say.warning(
                    "worker %d (pid %d) did not end %g s after the forced shutdown: killing it",
                    worker.index,
                    worker.process.pid,
                    seconds,
                )
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()

    def _signal_all(self) -> None:
        for worker in self.workers.values():
            if worker.alive:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signal.SIGTERM)

    # -- workers ------------------------------------------------------------------------------------

    async def _keep(self, index: int) -> None:
        """Run worker ``index`` until the supervisor stops: start it, and again after it dies or reloads."""
        failures = 0
        while not self.stopping:
            worker = await self._spawn(index)
            code = await worker.process.wait()
            if worker.link is not None:
                worker.link.close()
            if self.stopping:
                self._final[index] = code
                return
            if worker.restart:
                continue
            pid = worker.process.pid
            if time.monotonic() - worker.started >= STABLE_AFTER:
                failures = 0
            failures += 1
            if code == ExitCode.USAGE and not self.options.reload:  # with --reload, a fix is awaited (below)
                say.error("worker %d (pid %d) exited with status 2 (bad usage): not restarted", index, pid)
                self._give_up(ExitCode.USAGE)
                return
            if self.options.reload:
                say.warning(
                    "worker %d (pid %d) exited with status %s; it restarts at the next change", index, pid, code
                )
                self._changed.clear()
                await self._first(self._changed.wait())
                continue
            delay = restart_delay(failures, jitter=random.random())
            if delay is None:
                say.error(
                    "worker %d (pid %d) exited with status %s, %d times in a row: giving up", index, pid, code, failures
                )
                self._give_up(ExitCode.FAILED)
                return
            say.warning(
                "worker %d (pid %d) exited with status %s; restarting it in %.1f s (restart %d of at most %d in a row)",
                index,
                pid,
                code,
                delay,
                failures,
                MAX_RESTARTS,
            )
            self.restarts += 1
            await self._first(asyncio.sleep(delay))

    async def _first(self, awaitable: Awaitable[object]) -> None:
        """Wait for ``awaitable`` or for the supervisor to stop, whichever comes first."""
        waiting = asyncio.ensure_future(awaitable)
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({waiting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
            stopping.cancel()

    def _give_up(self, code: int) -> None:
        if self._gave_up is None:
            self._gave_up = code
        self.stop()

    async def _spawn(self, index: int) -> Worker:
        options = self.options
        ours, theirs = socket.socketpair()
        argv = [sys.executable, "-c", "from lily_mongo.cli import main; main()"]
        if options.debug:
            argv.append("--debug")
        argv += ["run", options.target, "--log-level", options.log_level, "--log-format", options.log_format]
        if options.http is not None:
            argv += ["--http-port", "0", "--http-host", "127.0.0.1"]
        argv += ["--worker-index", str(index), "--worker-fd", str(theirs.fileno())]
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, pass_fds=(theirs.fileno(),)
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        worker = Worker(index, process, time.monotonic(), link=ours)
        self.workers[index] = worker
        if self.stopping:  # a signal came while it was being started: it stops as the others do
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        say.info("worker %d started (pid %d)", index, process.pid, extra={"pid": process.pid})
        self._tasks.spawn(self._listen(worker), name=f"lily-worker-{index}-link")
        return worker

    async def _listen(self, worker: Worker) -> None:
        """Read what the worker reports on its socket (one JSON object per line) until it closes."""
        assert worker.link is not None
        worker.link.setblocking(False)
        loop = asyncio.get_running_loop()
        buffered = b""
        while True:
            try:
                data = await loop.sock_recv(worker.link, 4096)
            except OSError:
                return
            if not data:
                return
            buffered += data
            *lines, buffered = buffered.split(b"\n")
            for line in lines:
                with contextlib.suppress(ValueError):
                    message = json.loads(line)
                    if message.get("event") == "http":
                        worker.http_port = int(message["port"])
                    elif message.get("event") == "running":
                        worker.running = True

    async def _reap(self) -> None:
        """After a cancel (the supervisor itself failing): every worker still running is stopped and awaited."""
        alive = [worker for worker in self.workers.values() if worker.alive]
        if not alive:
            return
        self.stop()
        await asyncio.wait([asyncio.ensure_future(w.process.wait()) for w in alive], timeout=60)
        for worker in alive:
            if worker.alive:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()
                await worker.process.wait()

    # -- reload ------------------------------------------------------------------------------------

    async def _watch(self) -> None:
        """Restart every worker gracefully after a ``.py`` file under the current directory changed."""
        from watchfiles import PythonFilter, awatch

        root = Path.cwd()
        async for changes in awatch(root, watch_filter=PythonFilter(), stop_event=self._stopping):
            if self.stopping:
                return
            changed = sorted({str(Path(path).relative_to(root)) for _, path in changes if path.startswith(str(root))})
            say.info("changed: %s; restarting the workers gracefully", ", ".join(changed[:5]) or "files")
            for worker in self.workers.values():
                if worker.alive:
                    worker.restart = True
                    with contextlib.suppress(ProcessLookupError):
                        worker.process.send_signal(signal.SIGTERM)
            self._changed.set()

    # -- probes ------------------------------------------------------------------------------------

    async def _start_probes(self, host: str, port: int) -> WorkerProbes:
        try:
            from .probes import WorkerProbes  # optional dependencies: imported only when asked for
        except ModuleNotFoundError as exc:
            raise ConfigError(f"--http-port needs the 'http' extra: pip install 'lily-mongo[http]' ({exc})") from exc
        probes = WorkerProbes(host, port, self)
        try:
            await probes.start()
        except OSError as exc:
            await probes.stop()
            raise ConfigError(f"cannot listen on {host}:{port}: {bind_reason(exc, host)}") from exc
        return probes


async def supervise(options: WorkerOptions) -> int:
    """Run the workers until a signal (or until giving up on one); the exit status."""
    return await Supervisor(options).run()


class WorkerLink:
    """A ``--workers`` process's line to its supervisor: a socket it inherited (``--worker-fd``).

    The worker reports on it (its probe port, that it runs); the supervisor's end closing
    means the supervisor is gone, and the worker then shuts down gracefully.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    @classmethod
    def open(cls, fd: int) -> WorkerLink:
        try:
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            raise ConfigError(f"--worker-fd {fd} is not a socket: {exc}") from exc
        sock.setblocking(False)
        return cls(sock)

    def send(self, message: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # the supervisor is gone: wait_closed says so
            self._sock.send(json.dumps(message).encode() + b"\n")

    async def wait_closed(self, signals: ShutdownSignals) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                data = await loop.sock_recv(self._sock, 512)
            except OSError:
                data = b""
            if not data:
                break
        if not signals.received:
            say.warning("the worker supervisor is gone: shutting down")
            signals.receive(signal.SIGTERM)  # as a SIGTERM would
