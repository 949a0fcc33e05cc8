"""An embedded MongoDB-wire server for the demo, the test suite and developing a service.

Runs ``mongoeco``'s wire server (``pip install 'lily-mongo[embedded]'``, Python
>= 3.13) so real PyMongo clients talk to it over TCP. It is an emulator, not
MongoDB: docs/emulator.md lists every deviation that remains and how the library
copes with it.

The server started here corrects mongoeco where lily's semantics depend on
MongoDB's behaviour, in its own process only (subclasses of mongoeco's engine, wire
executor and sessions, made for that server: ``lily_mongo._embedded``), and the
commit failpoints (mongoeco's wire layer answers ``commitTransaction`` outside its
``failCommand`` check; the server consults the same failpoint state for commits,
before the commit applies, as MongoDB does):

* write conflicts per document, at the write, as WriteConflict (112) with the
  ``TransientTransactionError`` label; a transaction holds what it wrote, and a
  write outside any transaction waits for it, within its ``maxTimeMS``
  (MaxTimeMSExpired, 50);
* ``_id`` lookups, ``$in`` on ``_id`` and partial indexes through mongoeco's own
  hash maps instead of walks of the collection: costs flat in its size;
* ``hello`` as a replica set's primary, ``getParameter`` / ``setParameter`` of
  ``transactionLifetimeLimitSeconds``, enforced by a reaper; retryable writes
  answered once.

Each correction reaches into mongoeco's internals, so they are made only on the
mongoeco versions the suite ran on (:data:`TESTED_MONGOECO`); on any other the
server runs mongoeco as it ships and one INFO line on the ``lily_mongo`` logger says
so. ``--as-shipped`` (``EmbeddedServer(as_shipped=True)``) runs it as it ships on
purpose, for the tests and the benchmark that compare the two.

Run as ``python -m lily_mongo.embedded [--host H] [--port P] [--data DIR] [--replica-set]
[--as-shipped]``; it
prints ``READY <uri>`` on stdout once it accepts connections and stops on
SIGTERM/SIGINT. ``lily-mongo embedded`` runs the same server for developing your own
service: on port 27017 by default, in memory, or with ``--data DIR`` in mongoeco's
SQLite engine (kept between runs, but one transaction at a time: docs/emulator.md).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from ._versions import VersionRange, installed_version

__all__ = ["DATA_FILE", "DEFAULT_PORT", "TESTED_MONGOECO", "EmbeddedServer", "available", "main", "serve"]

log = logging.getLogger("lily_mongo")

# The mongoeco versions the suite runs on (uv.lock), up to the next minor release.
TESTED_MONGOECO: Final = VersionRange("mongoeco", (4, 11, 0), (4, 12))
DEFAULT_PORT: Final = 27017  # `lily-mongo embedded`: where a mongod would listen, so URIs need no change
DATA_FILE: Final = "lily-embedded.sqlite3"  # the database file `--data DIR` keeps
MAX_MAJORITY_LATENCY_MS: Final = 10_000  # `--majority-latency-ms` above 10 s models no replica set


def available() -> bool:
    """True when the embedded server can run here (``mongoeco`` installed: the ``embedded`` extra)."""
    return importlib.util.find_spec("mongoeco") is not None


class EmbeddedServer:
    """The embedded server in a subprocess on a free loopback port; a context manager.

    Used by the pytest plugin (``lily_mongo.pytest_plugin``), the demo and the test suite.
    """

    def __init__(self, *, as_shipped: bool = False, replica_set: bool = False, majority_latency_ms: float = 0) -> None:
        self._process: subprocess.Popen[str] | None = None
        self._as_shipped = as_shipped  # mongoeco without the corrections (the comparisons of the tests)
        self._replica_set = replica_set  # hello as a replica set's primary
        self._majority_latency_ms = majority_latency_ms  # a replica set's wait for the majority, modelled
        self.uri = ""

    def __enter__(self) -> EmbeddedServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> str:
        """Start it and return its MongoDB URI once it accepts connections."""
        command = [sys.executable, "-m", "lily_mongo.embedded", "--port", "0"]
        if self._as_shipped:
            command.append("--as-shipped")
        if self._replica_set:
            command.append("--replica-set")
        if self._majority_latency_ms:
            command += ["--majority-latency-ms", f"{self._majority_latency_ms:g}"]
        self._process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line.startswith("READY "):
            self.stop()
            raise RuntimeError(f"the embedded MongoDB-wire server did not start: {line.strip()!r}")
        self.uri = line.split(None, 1)[1].strip()
        return self.uri

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stdout is not None:
            process.stdout.close()


def _patch_commit_failpoints() -> bool:
    """Make ``commitTransaction`` consult the failpoints, on a tested mongoeco; True when it does."""
    version = installed_version("mongoeco")
    if not TESTED_MONGOECO.covers(version):
        log.info(
            "the embedded server runs mongoeco %s as it ships (tested: %s): a configureFailPoint on "
            "commitTransaction does not fire",
            version,
            TESTED_MONGOECO,
        )
        return False
    from mongoeco.errors import ConnectionFailure, OperationFailure
    from mongoeco.wire._executor_handlers import WireSpecialCommandHandlers

    original = WireSpecialCommandHandlers._handle_commit_transaction
    if getattr(original, "_lily_failpoints", False):
        return True

    async def handle_commit(self: Any, context: Any) -> dict[str, object]:
        state = getattr(self._client._engine, "_command_failpoint_state", None)
        injected = state.consume_fail_command("commitTransaction") if state is not None else None
        if injected is not None:
            if injected.block_time_ms > 0:
                await asyncio.sleep(injected.block_time_ms / 1000)
            if injected.close_connection:
                raise ConnectionFailure(injected.error_message, error_labels=injected.error_labels)
            raise OperationFailure(
                injected.error_message,
                code=injected.error_code,
                details={"failPoint": "failCommand", "commandName": "commitTransaction"},
                error_labels=injected.error_labels,
            )
        result: dict[str, object] = await original(self, context)
        return result

    handle_commit._lily_failpoints = True  # type: ignore[attr-defined]
    WireSpecialCommandHandlers._handle_commit_transaction = handle_commit  # type: ignore[method-assign]
    return True


def _ready_line(uri: str) -> None:
    print(f"READY {uri}", flush=True)


def _corrections() -> bool:
    """True when this mongoeco is one the corrections were tested on; else says so once at INFO."""
    version = installed_version("mongoeco")
    if TESTED_MONGOECO.covers(version):
        return True
    log.info(
        "the embedded server runs mongoeco %s as it ships (tested: %s): write conflicts are global, no writer "
        "waits, lookups walk collections, hello says standalone (docs/emulator.md)",
        version,
        TESTED_MONGOECO,
    )
    return False


async def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    data: Path | None = None,
    announce: Callable[[str], None] = _ready_line,
    as_shipped: bool = False,
    replica_set: bool = False,
    majority_latency: float = 0.0,
) -> None:
    """Serve until ``stop`` is set (or forever); ``announce(uri)`` once listening (``READY <uri>`` on stdout).

    In memory, or with ``data`` (an existing directory) in mongoeco's SQLite engine, whose file
    (:data:`DATA_FILE`) keeps the data between runs. With ``as_shipped``, mongoeco without any
    correction; with ``replica_set``, ``hello`` answers as a replica set's primary
    (docs/emulator.md); with ``majority_latency`` (seconds), every commit and majority write answers
    that long after it applied, a replica set's wait for the majority (a model for benchmarks).
    Made for a process of its own: the commit failpoint correction replaces
    a handler of mongoeco's for the whole process. Raises OSError when the address is taken or
    not this machine's.
    """
    stop = stop or asyncio.Event()
    engine = None
    if data is not None:
        from mongoeco.engines.sqlite import SQLiteEngine

        engine = SQLiteEngine(str(data / DATA_FILE))
    if not as_shipped and _corrections():
        _patch_commit_failpoints()
        from ._embedded.server import running

        async with running(
            host, port, sqlite=engine, replica_set=replica_set, majority_latency=majority_latency
        ) as server:
            announce(server.address.uri)
            if ready is not None:
                ready.set()
            await stop.wait()
        return
    from mongoeco.wire import AsyncMongoEcoProxyServer

    async with AsyncMongoEcoProxyServer(host=host, port=port, engine=engine) as shipped:
        announce(shipped.address.uri)
        if ready is not None:
            ready.set()
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: run the embedded server until a signal arrives."""
    parser = argparse.ArgumentParser(prog="python -m lily_mongo.embedded", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--as-shipped", action="store_true", help="run mongoeco without the corrections")
    parser.add_argument(
        "--replica-set", action="store_true", help="answer hello as a replica set's primary (set lily-embedded)"
    )
    parser.add_argument(
        "--majority-latency-ms",
        type=float,
        default=0.0,
        help="answer every commit and majority write this many milliseconds after it applied (default 0)",
    )
    parser.add_argument("--data", type=Path, help="keep the data in this existing directory (the SQLite engine)")
    args = parser.parse_args(argv)
    if not 0 <= args.majority_latency_ms <= MAX_MAJORITY_LATENCY_MS:
        parser.error(
            f"--majority-latency-ms is {args.majority_latency_ms:g}; it must be between 0 and {MAX_MAJORITY_LATENCY_MS}"
        )

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(
            args.host,
            args.port,
            stop=stop,
            data=args.data,
            as_shipped=args.as_shipped,
            replica_set=args.replica_set,
            majority_latency=args.majority_latency_ms / 1000,
        )

    try:
        asyncio.run(run())
    except ModuleNotFoundError as exc:
        print(f"the embedded server needs mongoeco[wire] (Python >= 3.13): {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


if __name__ == "__main__":
    main()
