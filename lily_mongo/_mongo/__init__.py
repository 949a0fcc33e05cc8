"""PyMongo details shared by the inbox and the outbox: labels, sessions, indexes, the scope of a transaction's
code; PyMongo errors mapped to lily errors (one table); opening a client, and the start-up check of a consumer's
client."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import socket
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import pymongo
from bson.errors import BSONError
from pymongo import AsyncMongoClient
from pymongo.errors import (
    ConfigurationError,
    ConnectionFailure,
    ExecutionTimeout,
    OperationFailure,
    PyMongoError,
    WriteConcernError,
)

from .._errors import ConfigError, LilyError, ScopeClosedError, TransportError
from .._inbox.protocol import TRANSACTION_LABELS
from .._redact import redact_url, scrub

if TYPE_CHECKING:
    from pymongo.asynchronous.client_session import AsyncClientSession
    from pymongo.asynchronous.collection import AsyncCollection
    from pymongo.asynchronous.database import AsyncDatabase

__all__ = [
    "DEFAULT_TRANSACTION_LIFETIME",
    "MONGO_ERRORS",
    "MongoFailure",
    "TransactionScope",
    "check_mongo",
    "describe_client",
    "discard_server_session",
    "ensure_index",
    "error_labels",
    "mongo_error",
    "mongo_errors",
    "mongo_failure",
    "open_mongo",
    "timed_out",
    "transaction_lifetime",
    "wait_expired",
    "write_unconfirmed",
]


def error_labels(exc: PyMongoError) -> frozenset[str]:
    """The transaction labels an error carries: errors are classified by label, never by code or message."""
    return frozenset(label for label in TRANSACTION_LABELS if exc.has_error_label(label))


def wait_expired(exc: PyMongoError) -> bool:
    """The command ran out of its ``maxTimeMS`` (MaxTimeMSExpired) before it could act.

    For a write outside a transaction that usually means it waited behind a transaction
    holding the document (docs/inbox.md, "Bounded waits"). PyMongo raises
    :class:`~pymongo.errors.ExecutionTimeout` for it (also when its own operation timeout
    leaves no time to send the command); a write that applied but whose replication wait
    ran out is a :func:`write_unconfirmed` instead.
    """
    return isinstance(exc, ExecutionTimeout)


def timed_out(exc: PyMongoError) -> bool:
    """The operation ran out of its bound: the server's ``maxTimeMS`` (:func:`wait_expired`), or the
    client's own operation timeout while it selected a server, connected or waited for the reply."""
    return bool(getattr(exc, "timeout", False)) or wait_expired(exc)


def write_unconfirmed(exc: PyMongoError) -> bool:
    """The write concern was not satisfied (not majority-acknowledged in time, or refused).

    The write may have applied on the primary and may still be rolled back: nothing it
    returned can be trusted, so the caller treats it as a database failure.
    """
    return isinstance(exc, WriteConcernError)


# MongoDB's default transactionLifetimeLimitSeconds, assumed where the server does not say.
DEFAULT_TRANSACTION_LIFETIME = 60.0


async def transaction_lifetime(client: AsyncMongoClient[Any]) -> float | None:
    """The server's ``transactionLifetimeLimitSeconds``, or None where ``getParameter`` is refused.

    Unprivileged users (MongoDB Atlas among them) get ``Unauthorized``; some servers and
    emulators do not know the command at all.
    """
    try:
        reply = await client.admin.command({"getParameter": 1, "transactionLifetimeLimitSeconds": 1})
    except PyMongoError:
        return None
    value = reply.get("transactionLifetimeLimitSeconds")
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        return None
    return float(value)


def discard_server_session(session: AsyncClientSession) -> None:
    """Never reuse a session whose transaction outcome is unclear.

    MongoDB aborts a session's open transaction when the next transaction on
    that session starts; some emulators instead keep it open and commit it with
    the next one. Marking the server session dirty makes PyMongo drop it from
    its pool, which is harmless on MongoDB (the server times it out).
    """
    server_session = getattr(session, "_server_session", None)
    mark_dirty = getattr(server_session, "mark_dirty", None)
    if callable(mark_dirty):
        mark_dirty()


class TransactionScope:
    """What the code of one transaction holds: its session and the database, until the transaction ends.

    The base of a handler's :class:`~lily_mongo.MongoScope` and of
    :class:`~lily_mongo.OutboxTransaction`; once :meth:`close` ran, every use raises
    :class:`ScopeClosedError` with the subclass's ``_closed_message``.
    """

    __slots__ = ("_database", "_open", "_session")

    _closed_message: ClassVar[str] = "this transaction has ended; it cannot be used any more"

    def __init__(self, session: AsyncClientSession, database: AsyncDatabase[Any]) -> None:
        self._session = session
        self._database = database
        self._open = True

    def _check(self) -> None:
        if not self._open:
            raise ScopeClosedError(self._closed_message)

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def session(self) -> AsyncClientSession:
        """The transaction's session, for every operation that belongs to the transaction (``session=``)."""
        self._check()
        return self._session

    @property
    def database(self) -> AsyncDatabase[Any]:
        """The database (the consumer's, or the outbox's)."""
        self._check()
        return self._database

    def close(self) -> None:
        self._open = False


async def ensure_index(
    collection: AsyncCollection[Any], name: str, keys: list[tuple[str, int]], *, passive: bool, **options: Any
) -> None:
    """Create the index (idempotent), or in passive mode only verify that it exists."""
    if passive:
        if name not in await collection.index_information():
            raise ConfigError(f"index {name!r} is missing on collection {collection.name!r} (passive mode)")
        return
    try:
        await collection.create_index(keys, name=name, **options)
    except OperationFailure as exc:
        raise ConfigError(f"index {name!r} on {collection.name!r} exists with other options: {exc.details}") from exc


# -- PyMongo errors, mapped at one boundary ---------------------------------------------------------


class MongoFailure(enum.Enum):
    """What a PyMongo exception says happened."""

    LOGIN_REFUSED = "the server refused the login"
    UNREACHABLE = "no server answered in time"
    INVALID_CONFIGURATION = "the URI or a client option is not valid"
    FAILED = "the server refused or failed an operation"


MONGO_ERRORS: Mapping[type[BaseException], MongoFailure] = MappingProxyType(
    {
        ConfigurationError: MongoFailure.INVALID_CONFIGURATION,  # InvalidURI included
        ConnectionFailure: MongoFailure.UNREACHABLE,  # AutoReconnect, ServerSelectionTimeoutError, NetworkTimeout, ...
        OperationFailure: MongoFailure.FAILED,  # a refused login too: see mongo_failure
        PyMongoError: MongoFailure.FAILED,
        BSONError: MongoFailure.FAILED,  # a document PyMongo cannot encode (DocumentTooLarge included)
    }
)
# The server's code for a refused login (AuthenticationFailed): the one error classified by
# code, since MongoDB gives it no label.
_AUTHENTICATION_FAILED = 18
MONGODB = "MongoDB"  # TransportError.service of every error this module raises


def mongo_failure(exc: BaseException) -> MongoFailure | None:
    """What ``exc`` says happened (its most specific class in :data:`MONGO_ERRORS`), or None."""
    if isinstance(exc, OperationFailure) and exc.code == _AUTHENTICATION_FAILED:
        return MongoFailure.LOGIN_REFUSED
    for cls in type(exc).__mro__:
        failure = MONGO_ERRORS.get(cls)
        if failure is not None:
            return failure
    return None


def mongo_error(exc: BaseException, what: str, *, uri: str | None = None) -> LilyError:
    """The lily error for ``what`` ("reading the inbox statistics") failing with ``exc``.

    With ``uri``, the sentence names the server (its password redacted). An exception
    :data:`MONGO_ERRORS` does not name is returned as a :class:`LilyError` saying so.
    """
    at = f" at {redact_url(uri)}" if uri else ""
    failure = mongo_failure(exc)
    if failure is MongoFailure.INVALID_CONFIGURATION:
        if uri:
            return ConfigError(f"the MongoDB URI {redact_url(uri)} is not valid: {scrub(str(exc), uri)}"[:300])
        return ConfigError(f"MongoDB configuration is not valid ({what}): {exc}"[:300])
    if failure is MongoFailure.LOGIN_REFUSED:
        return TransportError(f"MongoDB{at} refused the login: check the user and password", service=MONGODB)
    if failure is MongoFailure.UNREACHABLE:
        return TransportError(
            f"MongoDB is not reachable{at} (no server answered in time)", unreachable=True, service=MONGODB
        )
    detail = scrub(str(exc), uri) if uri else str(exc)
    return TransportError(f"MongoDB{at} refused {what}: {type(exc).__name__}: {detail}"[:500], service=MONGODB)


@contextlib.contextmanager
def mongo_errors(what: str, *, uri: str | None = None) -> Iterator[None]:
    """``with mongo_errors("reading the inbox statistics"):`` raises :func:`mongo_error` for
    every exception :data:`MONGO_ERRORS` names and lets the others through."""
    try:
        yield
    except Exception as exc:
        if mongo_failure(exc) is None:
            raise
        raise mongo_error(exc, what, uri=uri) from exc


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
            if exc.code == _AUTHENTICATION_FAILED:
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
