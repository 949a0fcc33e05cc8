"""PyMongo errors: the labels read from them, what a wait that ran out looks like, and the one table that maps
them to lily's errors."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from bson.errors import BSONError
from pymongo.errors import (
    ConfigurationError,
    ConnectionFailure,
    ExecutionTimeout,
    OperationFailure,
    PyMongoError,
    WriteConcernError,
)

from .._errors import ConfigError, LilyError, TransportError
from .._redact import redact_url, scrub
from .rules import TRANSACTION_LABELS

if TYPE_CHECKING:
    pass


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
AUTHENTICATION_FAILED = 18
MONGODB = "MongoDB"  # TransportError.service of every error this module raises


def mongo_failure(exc: BaseException) -> MongoFailure | None:
    """What ``exc`` says happened (its most specific class in :data:`MONGO_ERRORS`), or None."""
    if isinstance(exc, OperationFailure) and exc.code == AUTHENTICATION_FAILED:
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
