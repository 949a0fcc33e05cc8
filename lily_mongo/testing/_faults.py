"""``Faults``: MongoDB's own failures, injected with ``configureFailPoint`` (docs/testing.md)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pymongo.errors import OperationFailure

from .._checks import check_bool, check_int
from .._errors import ConfigError, LilyError
from .._mongo.rules import TRANSIENT_LABEL, UNKNOWN_COMMIT_LABEL
from .._text import describe_value

if TYPE_CHECKING:
    from pymongo import AsyncMongoClient


_INT32_MAX = 2**31 - 1  # failCommand's counts, codes and milliseconds are 32-bit integers


class FaultInjectionUnsupported(LilyError):
    """The MongoDB server refuses ``configureFailPoint`` (MongoDB needs ``enableTestCommands=1``)."""


class Faults:
    """MongoDB failures for a test, through the server's own ``configureFailPoint failCommand``.

    The embedded MongoDB-wire server supports it; MongoDB does when started with
    ``--setParameter enableTestCommands=1``; a server that refuses it raises
    :class:`FaultInjectionUnsupported`. Each call replaces the previous failpoint (the
    server holds one ``failCommand`` failpoint). Used as an async context manager, it
    turns the failpoint off on the way out, whatever happened inside::

        async with Faults(client) as faults:
            await faults.fail(["commitTransaction"], code=50, labels=["UnknownTransactionCommitResult"])
            ...
    """

    def __init__(self, client: AsyncMongoClient[Any]) -> None:
        self._client = client

    async def __aenter__(self) -> Faults:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.clear()

    async def fail(
        self,
        commands: Iterable[str],
        *,
        code: int = 112,
        labels: Iterable[str] = (),
        times: int | None = 1,
        close_connection: bool = False,
        block_ms: int = 0,
        message: str | None = None,
        namespace: str | None = None,
    ) -> None:
        """The next ``times`` of ``commands`` (one name or several; every one until :meth:`clear` with
        ``times=None``) fail.

        Each answers error ``code`` with the error ``labels`` (and ``message`` as its
        text). ``close_connection`` drops the connection instead of answering;
        ``block_ms`` holds the connection that long before the failure.
        ``namespace`` (``"database.collection"``) limits the failure to one
        collection, so the inbox records, heartbeats and relay traffic elsewhere
        are not hit by accident.
        """
        names = [commands] if isinstance(commands, str) else list(commands)
        if not names:
            raise ConfigError("commands must name at least one command, got none")
        for name in names:
            if not isinstance(name, str) or not name:
                raise ConfigError(f"commands must be command names, got {describe_value(name)}")
        data: dict[str, Any] = {"failCommands": names, "errorCode": check_int("code", code, 0, _INT32_MAX)}
        if error_labels := list(labels):
            data["errorLabels"] = error_labels
        if check_bool("close_connection", close_connection):
            data["closeConnection"] = True
        if check_int("block_ms", block_ms, 0, _INT32_MAX):
            data["blockConnection"] = True
            data["blockTimeMS"] = block_ms
        if message is not None:
            data["errorMessage"] = message
        if namespace is not None:
            data["namespace"] = namespace
        mode: object = "alwaysOn" if times is None else {"times": check_int("times", times, 1, _INT32_MAX)}
        await self._command({"configureFailPoint": "failCommand", "mode": mode, "data": data})

    async def transient_operations(self, times: int = 1, commands: Iterable[str] = ("insert",)) -> None:
        """The next ``times`` of ``commands`` fail with ``WriteConflict`` and ``TransientTransactionError``.

        Inserts by default: ``update`` is left out because the inbox's completion is the
        transaction's first write (an update), so a failure there replays before the handler
        ran at all; ``delete`` because the inbox releases a failed attempt's lease with one.
        """
        await self.fail(commands, times=times, labels=[TRANSIENT_LABEL], code=112)

    async def transient_commits(self, times: int = 1) -> None:
        """The next ``times`` commits fail (not applied) with ``TransientTransactionError``: the attempt replays."""
        await self.fail(["commitTransaction"], times=times, labels=[TRANSIENT_LABEL], code=112)

    async def ambiguous_commits(self, times: int = 1) -> None:
        """The next ``times`` commits answer ``UnknownTransactionCommitResult`` (the server does not apply them).

        The inbox retries the commit, then reconciles from the record. A commit that applies
        but whose reply is lost cannot be made by ``failCommand`` (it fails before the commit);
        the library's own tests cut the reply on the network for that case.
        """
        await self.fail(["commitTransaction"], times=times, labels=[UNKNOWN_COMMIT_LABEL], code=50)

    async def clear(self) -> None:
        """Turn the failpoint off (whoever set it: a test, or a process sharing the server)."""
        await self._command({"configureFailPoint": "failCommand", "mode": "off"})

    async def _command(self, command: dict[str, Any]) -> None:
        try:
            await self._client.admin.command(command)
        except OperationFailure as exc:
            raise FaultInjectionUnsupported(
                f"the server refused configureFailPoint ({exc.code}); MongoDB needs enableTestCommands=1"
            ) from exc
