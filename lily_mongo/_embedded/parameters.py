"""``getParameter`` and ``setParameter`` for the one parameter the server honours: the transaction lifetime.

mongoeco answers neither ("unsupported wire command"). MongoDB's server aborts a
transaction older than ``transactionLifetimeLimitSeconds`` (default 60) and says the
limit to a privileged user; lily reads it at start (docs/inbox.md, "The transaction
lifetime"). The embedded server enforces it (its reaper, :mod:`.server`), so it
answers it too, and lets it be changed at run time as MongoDB does.
"""

from __future__ import annotations

from typing import Any, Final

from mongoeco.errors import OperationFailure

from .transactions import TransactionBook

__all__ = ["COMMANDS", "LIFETIME", "answer"]

LIFETIME: Final = "transactionLifetimeLimitSeconds"
COMMANDS: Final = ("getParameter", "setParameter")
_OPTIONS: Final = ("comment", "lsid", "$readPreference")  # keys of the command that name no parameter


def _invalid(message: str) -> OperationFailure:
    return OperationFailure(message, code=72, details={"codeName": "InvalidOptions"})


def answer(context: Any, book: TransactionBook) -> dict[str, object]:
    """The reply to ``getParameter`` / ``setParameter`` (``context`` is mongoeco's request context)."""
    name = context.command_name
    if context.db_name != "admin":
        raise OperationFailure(
            f"{name} may only be run against the admin database.", code=13, details={"codeName": "Unauthorized"}
        )
    document = context.command_document
    asked = [key for key in document if key != name and key not in _OPTIONS]
    if name == "getParameter":
        everything = document[name] == "*" or (isinstance(document[name], dict) and document[name].get("allParameters"))
        if not everything and LIFETIME not in asked:
            raise _invalid("no option found to get")
        return {LIFETIME: int(book.lifetime), "ok": 1.0}
    unknown = [key for key in asked if key != LIFETIME]
    if unknown:
        raise _invalid(f"attempted to set unrecognized parameter [{unknown[0]}], use help:true to see options ")
    if not asked:
        raise _invalid("no option found to set, use help:true to see options ")
    value = document[LIFETIME]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OperationFailure(
            f"{LIFETIME} must be an integer of at least 1, not {value!r}", code=2, details={"codeName": "BadValue"}
        )
    was = int(book.lifetime)
    book.lifetime = float(value)
    return {"was": was, "ok": 1.0}
