"""MongoDB's error replies for the embedded server, and the two signals its engine raises.

MongoDB answers a write conflict inside a transaction, a transaction the server
aborted, and a wait that ran out of its ``maxTimeMS`` with a top-level command error
(``ok: 0``, a code, its name and, for the transient ones, the
``TransientTransactionError`` label), never with a per-item ``writeErrors`` entry:
drivers and lily classify them by that label (docs/emulator.md).

mongoeco's write commands turn any ``OperationFailure`` raised while they write into
such a ``writeErrors`` entry, and its transaction commit retries a labelled failure
in place. So the engine does not raise these errors where they arise: it raises a
:class:`Refusal` (or, for a write outside a transaction that must wait for a
document, a :class:`Held`), which derive from ``BaseException`` so that mongoeco's
``except Exception`` handlers let them through (its rollbacks catch ``BaseException``
and re-raise, so every partial change is undone first). The wire layer
(:mod:`.commands`) turns a :class:`Refusal` into the reply it carries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from mongoeco.errors import OperationFailure

if TYPE_CHECKING:
    from .locks import DocumentLock

__all__ = [
    "MAX_TIME_MS_EXPIRED",
    "NO_SUCH_TRANSACTION",
    "TRANSIENT",
    "WRITE_CONFLICT",
    "Held",
    "Refusal",
    "max_time_expired",
    "no_such_transaction",
    "write_conflict",
]

WRITE_CONFLICT: Final = 112
MAX_TIME_MS_EXPIRED: Final = 50
NO_SUCH_TRANSACTION: Final = 251
TRANSIENT: Final = "TransientTransactionError"


def write_conflict(detail: str) -> OperationFailure:
    """WriteConflict (112), labelled transient: what MongoDB answers the second writer of a document."""
    return OperationFailure(
        "WriteConflict error: this operation conflicted with another operation. Please retry your operation "
        f"or multi-document transaction. ({detail})",
        code=WRITE_CONFLICT,
        details={"codeName": "WriteConflict"},
        error_labels=(TRANSIENT,),
    )


def max_time_expired() -> OperationFailure:
    """MaxTimeMSExpired (50): the command's ``maxTimeMS`` ran out while it waited for a document."""
    return OperationFailure(
        "operation exceeded time limit", code=MAX_TIME_MS_EXPIRED, details={"codeName": "MaxTimeMSExpired"}
    )


def no_such_transaction(reason: str) -> OperationFailure:
    """NoSuchTransaction (251), labelled transient: the server aborted the session's transaction."""
    return OperationFailure(
        f"Transaction has been aborted: {reason}.",
        code=NO_SUCH_TRANSACTION,
        details={"codeName": "NoSuchTransaction"},
        error_labels=(TRANSIENT,),
    )


class Refusal(BaseException):
    """The command fails with ``error`` as a top-level reply (see the module docstring)."""

    def __init__(self, error: OperationFailure) -> None:
        super().__init__(str(error))
        self.error = error


class Held(BaseException):
    """A write outside any transaction reached a document that ``lock``'s transaction holds: it must wait."""

    def __init__(self, lock: DocumentLock) -> None:
        super().__init__("the document is held by a transaction")
        self.lock = lock
