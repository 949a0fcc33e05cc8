"""PyMongo details shared by the inbox and the outbox: the errors and their one mapping table (``errors``),
sessions and a transaction's scope (``sessions``), the transaction skeleton (``transactions``), indexes,
and opening and checking a client (``connect``)."""

from __future__ import annotations

from .connect import check_mongo, describe_client, open_mongo
from .errors import (
    MONGO_ERRORS,
    MongoFailure,
    error_labels,
    mongo_error,
    mongo_errors,
    mongo_failure,
    timed_out,
    wait_expired,
    write_unconfirmed,
)
from .indexes import ensure_index
from .rules import TRANSACTION_LABELS, TRANSIENT_LABEL, UNKNOWN_COMMIT_LABEL
from .sessions import (
    DEFAULT_TRANSACTION_LIFETIME,
    TransactionScope,
    discard_server_session,
    server_clock_offset,
    transaction_lifetime,
)

__all__ = [
    "DEFAULT_TRANSACTION_LIFETIME",
    "MONGO_ERRORS",
    "TRANSACTION_LABELS",
    "TRANSIENT_LABEL",
    "UNKNOWN_COMMIT_LABEL",
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
    "server_clock_offset",
    "timed_out",
    "transaction_lifetime",
    "wait_expired",
    "write_unconfirmed",
]
