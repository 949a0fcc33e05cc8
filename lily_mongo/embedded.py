"""An embedded MongoDB-wire server for the demo and the test suite.

Runs ``mongoeco``'s wire server (``pip install 'lily-mongo[embedded]'``, Python
>= 3.13) so real PyMongo clients talk to it over TCP. It is an emulator, not
MongoDB: see docs/emulator.md for every deviation the library copes with.

One deviation is corrected here, in this process only: mongoeco's wire layer
answers ``commitTransaction`` outside its ``failCommand`` check, so a
``configureFailPoint`` on ``commitTransaction`` never fires. MongoDB does fire
it (before the commit applies), and the commit-failure tests rely on that, so
the server started here consults the same failpoint state for commits. The
correction replaces a private mongoeco handler, so it is made only on the
mongoeco versions the suite ran on (:data:`TESTED_MONGOECO`); on any other the
server runs as mongoeco ships it (commit failpoints do not fire) and one INFO
line on the ``lily_mongo`` logger says so (docs/emulator.md).

Run as ``python -m lily_mongo.embedded [--host H] [--port P]``; it prints
``READY <uri>`` on stdout once it accepts connections and stops on SIGTERM/SIGINT.
``lily-mongo embedded`` runs the same server for developing your own service:
on port 27017 by default, in memory, or with ``--data DIR`` in mongoeco's SQLite
engine (kept between runs, but one transaction at a time: docs/emulator.md).
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


def available() -> bool:
    """True when the embedded server can run here (``mongoeco`` installed: the ``embedded`` extra)."""
    return importlib.util.find_spec("mongoeco") is not None


class EmbeddedServer:
    """The embedded server in a subprocess on a free loopback port; a context manager.

    Used by the pytest plugin (``lily_mongo.pytest_plugin``), the demo and the test suite.
    """

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None
        self.uri = ""

    def __enter__(self) -> EmbeddedServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> str:
        """Start it and return its MongoDB URI once it accepts connections."""
        self._process = subprocess.Popen(
            [sys.executable, "-m", "lily_mongo.embedded", "--port", "0"], stdout=subprocess.PIPE, text=True
        )
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


async def serve(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    data: Path | None = None,
    announce: Callable[[str], None] = _ready_line,
) -> None:
    """Serve until ``stop`` is set (or forever); ``announce(uri)`` once listening (``READY <uri>`` on stdout).

    In memory, or with ``data`` (an existing directory) in mongoeco's SQLite engine, whose file
    (:data:`DATA_FILE`) keeps the data between runs. Raises OSError when the address is
    taken or not this machine's.
    """
    from mongoeco.wire import AsyncMongoEcoProxyServer

    _patch_commit_failpoints()
    stop = stop or asyncio.Event()
    engine = None
    if data is not None:
        from mongoeco.engines.sqlite import SQLiteEngine

        engine = SQLiteEngine(str(data / DATA_FILE))
    async with AsyncMongoEcoProxyServer(host=host, port=port, engine=engine) as server:
        announce(server.address.uri)
        if ready is not None:
            ready.set()
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: run the embedded server until a signal arrives."""
    parser = argparse.ArgumentParser(prog="python -m lily_mongo.embedded", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(args.host, args.port, stop=stop)

    try:
        asyncio.run(run())
    except ModuleNotFoundError as exc:
        print(f"the embedded server needs mongoeco[wire] (Python >= 3.13): {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


if __name__ == "__main__":
    main()
