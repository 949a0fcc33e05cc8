"""Opening a client, and the start-up check of a consumer's client: reachable, logged in, serving
transactions, each failure said in one line (docs/lifecycle.md, section 2)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import TYPE_CHECKING, Any

import pymongo
from pymongo import AsyncMongoClient
from pymongo.errors import (
    OperationFailure,
    PyMongoError,
)

from .._errors import TransportError
from .errors import AUTHENTICATION_FAILED, MONGODB, MongoFailure, mongo_error, mongo_errors, mongo_failure

if TYPE_CHECKING:
    pass


async def open_mongo(uri: str, *, timeout: float = 10.0) -> AsyncMongoClient[Any]:
    """A client for ``uri`` that has answered a ping; the caller closes it.

    ``timeout`` bounds server selection unless the URI sets ``serverSelectionTimeoutMS``
    itself. Raises :class:`ConfigError` for a URI PyMongo refuses, :class:`TransportError`
    when no server answers or the login is refused, with the URI redacted.
    """
    options: dict[str, Any] = {}
    if "serverselectiontimeoutms" not in uri.lower():
        options["serverSelectionTimeoutMS"] = int(timeout * 1000)
    with mongo_errors("opening a client", uri=uri):
        client: AsyncMongoClient[Any] = AsyncMongoClient(uri, **options)
    try:
        with mongo_errors("the ping", uri=uri):
            await client.admin.command("ping")
    except BaseException:
        await client.close()
        raise
    return client


# -- the start-up check ------------------------------------------------------------------------------

_PROBE_SECONDS = 2.0  # the TCP probe that says why no server answered (refused, unknown host, timed out)
_PROBED_SEEDS = 8
_EMBEDDED_HINT = "`lily-mongo embedded` runs one for development"


def describe_client(client: AsyncMongoClient[Any]) -> str:
    """The client's servers as a URI without credentials or options (``mongodb://h1:27017,h2:27017/``),
    with its replica set name: what an error may show of a client whose URI it never saw."""
    seeds = _seeds(client)
    hosts = ",".join(f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in seeds) or "?"
    name = client.options.replica_set_name
    return f"mongodb://{hosts}/" + (f"?replicaSet={name}" if name else "")


def _seeds(client: AsyncMongoClient[Any]) -> tuple[tuple[str, int], ...]:
    addresses = client.topology_description.server_descriptions()
    return tuple((host, port if port is not None else 27017) for host, port in sorted(addresses))


async def check_mongo(
    client: AsyncMongoClient[Any], *, database: str, collection: str, timeout: float, transactions: bool
) -> None:
    """Fail fast, in one line, when the consumer's MongoDB cannot serve it (docs/lifecycle.md, section 2).

    Within ``timeout`` seconds (``pymongo.timeout``: the client's own options are left as
    they are) the server must answer ``hello``; with ``transactions`` it must also be a
    replica set member or a mongos, or (a server that describes itself as standalone, as
    some emulators do) run a transaction that reads ``collection``. Raises a
    :class:`TransportError` (``unreachable`` when nothing answered) saying which of these
    failed, with the client's servers and what to do; the inbox's set-up would otherwise
    wait for the client's own server selection timeout (30 s by default) and say less.
    """
    seeds = _seeds(client)
    where = describe_client(client)
    try:
        with pymongo.timeout(timeout):
            hello = await client.admin.command("hello")
            if transactions and not (hello.get("setName") or hello.get("msg") == "isdbgrid"):
                await _run_a_transaction(client, database, collection)
    except _NoTransactions as exc:
        raise TransportError(
            f"MongoDB at {where} is a standalone server and refused a transaction ({exc}); the inbox runs each "
            "handler in a transaction, which needs a replica set or a sharded cluster: start mongod with "
            "--replSet and run rs.initiate() once (see compose.yaml), or use `lily-mongo embedded` for development",
            service=MONGODB,
        ) from exc.__cause__
    except Exception as exc:
        failure = mongo_failure(exc)
        if failure is MongoFailure.UNREACHABLE or (isinstance(exc, PyMongoError) and exc.timeout):
            reason, advice = await _unreachable_reason(client, seeds, timeout)
            raise TransportError(
                f"MongoDB is not reachable at {where} ({reason}); {advice}", unreachable=True, service=MONGODB
            ) from exc
        if failure is MongoFailure.LOGIN_REFUSED:
            raise TransportError(
                f"MongoDB at {where} refused the login: check the user and password of the consumer's mongo_client",
                service=MONGODB,
            ) from exc
        if failure is None:
            raise
        raise mongo_error(exc, "the start-up check") from exc


class _NoTransactions(Exception):
    """The server refused the probe transaction (its reason is the message)."""


async def _run_a_transaction(client: AsyncMongoClient[Any], database: str, collection: str) -> None:
    """One read in a transaction, aborted: MongoDB refuses it on a standalone server (IllegalOperation)."""
    async with client.start_session() as session:
        await session.start_transaction()
        try:
            await client[database][collection].find_one({"_id": "lily-start-check"}, session=session)
        except OperationFailure as exc:
            if exc.code == AUTHENTICATION_FAILED:
                raise
            reason = (exc.details or {}).get("codeName") or f"code {exc.code}"
            raise _NoTransactions(f"{reason}: {str(exc).split(', full error')[0]}"[:200]) from exc
        finally:
            if session.in_transaction:
                with contextlib.suppress(PyMongoError):
                    await session.abort_transaction()


async def _unreachable_reason(
    client: AsyncMongoClient[Any], seeds: tuple[tuple[str, int], ...], timeout: float
) -> tuple[str, str]:
    """Why no server could be selected, in a few words, and what to do: what a TCP connection to each
    seed says (connection refused, unknown host, timed out), or what the topology shows."""
    description = client.topology_description
    name = client.options.replica_set_name
    if (
        name
        and not description.has_known_servers
        and not any(server.error for server in description.server_descriptions().values())
    ):
        return (
            f"no member of replica set {name!r} answered within {timeout:g} s",
            "a server outside that set is ignored: drop replicaSet= from the URI for a standalone server "
            "(the embedded one included)",
        )
    hint = f"is it running? ({_EMBEDDED_HINT})"
    if not seeds:
        return f"no server answered within {timeout:g} s", hint
    reasons = await asyncio.gather(*(_tcp_reason(host, port) for host, port in seeds[:_PROBED_SEEDS]))
    if all(reason is None for reason in reasons):
        return f"a server accepted the connection but no MongoDB answered within {timeout:g} s", hint
    return ", ".join(sorted({reason for reason in reasons if reason is not None})), hint


async def _tcp_reason(host: str, port: int) -> str | None:
    """What connecting to ``host:port`` says (None: it connected)."""
    try:
        async with asyncio.timeout(_PROBE_SECONDS):
            _reader, writer = await asyncio.open_connection(host, port)
    except ConnectionRefusedError:
        return "connection refused"
    except socket.gaierror:
        return "unknown host"
    except TimeoutError:
        return "timed out"
    except OSError as exc:
        return (exc.strerror or type(exc).__name__).lower()
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None
