"""The open transactions of the embedded server: what each wrote, what it holds, which the server aborted.

mongoeco's memory engine gives each transaction a snapshot (persistent copies of
every collection's roots, taken at its start) and, at commit, refuses it if
*anything* was written since (one global version number), else installs the
transaction's copies of the collections it touched over the live ones. This book
keeps, per transaction, what MongoDB's per-document rule needs instead
(docs/emulator.md, "The corrections"):

* ``written``: each document the transaction wrote, with the version it wrote over
  (the one its snapshot held). The first write checks that version is still the
  committed one and takes the document's lock (:mod:`.locks`); the commit applies
  each written document's last version over the live collection, and nothing else;
* ``aborted``: why the server aborted it (a write conflict, its age): its next
  command fails with NoSuchTransaction, as on MongoDB;
* ``whole``: it changed a collection's definition (created an index, dropped a
  collection, ...) or an ``_id``'s type: such a commit takes mongoeco's own path,
  under its global rule (docs/emulator.md);
* ``yields``: its client may have given it up: a commit of it failed with an unknown
  outcome, or the connection of its last command was lost. MongoDB keeps such a
  transaction, and its documents, until the client uses the session again or the
  lifetime runs out; here the next writer that needs one of its documents aborts it
  instead of waiting or conflicting (a deviation, docs/emulator.md "Deviations
  that remain"). Until then a retry of its commit still commits.

Versions are compared by identity: mongoeco replaces a document's stored version
on every write and shares unchanged ones between snapshots.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from .errors import Refusal, no_such_transaction, write_conflict
from .locks import DocumentLocks, LockKey

__all__ = ["ABSENT", "DEFAULT_LIFETIME", "Transaction", "TransactionBook"]

ABSENT: Final[Any] = object()  # no version: the document does not exist (yet, or any more)
DEFAULT_LIFETIME: Final = 60.0  # MongoDB's transactionLifetimeLimitSeconds


@dataclass(slots=True, eq=False)
class Transaction:
    """One open transaction, of the session ``session_id``."""

    session_id: str
    session: Any  # mongoeco's ClientSession
    started: float = field(default_factory=time.monotonic)
    written: dict[LockKey, Any] = field(default_factory=dict)  # document -> the version it wrote over
    aborted: str | None = None
    whole: bool = False
    yields: bool = False
    running: int = 0  # its commands in progress
    connection: tuple[str, int] | None = None  # the client address its last command came from


class TransactionBook:
    """The transactions of one engine, and the locks they hold."""

    def __init__(self, lifetime: float = DEFAULT_LIFETIME) -> None:
        self.locks = DocumentLocks()
        self.lifetime = lifetime  # transactionLifetimeLimitSeconds (getParameter and setParameter answer it)
        self._open: dict[str, Transaction] = {}

    def __iter__(self) -> Iterator[Transaction]:
        return iter(list(self._open.values()))

    def get(self, session_id: str) -> Transaction | None:
        return self._open.get(session_id)

    def begin(self, session: Any) -> Transaction:
        self.end(session.session_id)
        transaction = Transaction(session.session_id, session)
        self._open[session.session_id] = transaction
        return transaction

    def end(self, session_id: str) -> None:
        """The transaction committed or aborted: forget it, release its documents."""
        self._open.pop(session_id, None)
        self.locks.release_all(session_id)

    def abort(self, transaction: Transaction, reason: str) -> None:
        """The server aborts ``transaction`` (MongoDB's rule on a write conflict and on age): its documents
        are released now; its next command is refused (:meth:`refusal`) until the session ends it."""
        if transaction.aborted is None:
            transaction.aborted = reason
        transaction.written.clear()  # its commit is refused from now on: keep no document alive
        self.locks.release_all(transaction.session_id)

    def refusal(self, session_id: str) -> Refusal | None:
        """NoSuchTransaction for a command of a transaction the server aborted."""
        transaction = self._open.get(session_id)
        if transaction is None or transaction.aborted is None:
            return None
        return Refusal(no_such_transaction(transaction.aborted))

    def conflict(self, transaction: Transaction, detail: str) -> Refusal:
        """Abort ``transaction`` for a write conflict; the refusal its command fails with."""
        self.abort(transaction, "it conflicted with another write")
        return Refusal(write_conflict(detail))

    def admit(self, transaction: Transaction, key: LockKey, snapshot_version: object, live_version: object) -> None:
        """``transaction`` writes the document ``key`` (its snapshot holds ``snapshot_version``, the live
        collection ``live_version``): refuse with WriteConflict unless it may, else hold the document."""
        if transaction.aborted is not None:
            raise Refusal(no_such_transaction(transaction.aborted))
        lock = self.locks.holder(key)
        if lock is not None and lock.owner == transaction.session_id:
            return  # written before by the same transaction
        if lock is not None and not self.take_over(lock.owner):
            raise self.conflict(transaction, f"{_name(key)} is being written by another transaction")
        if live_version is not snapshot_version:
            raise self.conflict(transaction, f"{_name(key)} was written after this transaction's snapshot")
        self.locks.take(key, transaction.session_id)
        transaction.written[key] = snapshot_version

    def take_over(self, owner: str) -> bool:
        """A writer needs a document ``owner``'s transaction holds: True if that transaction yields it
        (and is aborted, its documents released), False if the writer must wait or conflict."""
        holder = self._open.get(owner)
        if holder is None or not holder.yields or holder.running:
            return False
        self.abort(holder, "its client gave it up and another writer needed its documents")
        return True

    def connection_lost(self, client: tuple[str, int]) -> None:
        """The connection from ``client`` closed: the transactions whose last command came over it yield."""
        for transaction in self._open.values():
            if transaction.connection == client:
                self.mark_yielding(transaction)

    def mark_yielding(self, transaction: Transaction) -> None:
        """``transaction``'s client may have given it up (see the module docstring): the writers waiting
        for its documents look again once no command of it runs."""
        transaction.yields = True
        if not transaction.running:
            self.locks.nudge(transaction.session_id)

    def command_ended(self, transaction: Transaction) -> None:
        transaction.running -= 1
        if transaction.yields and not transaction.running:
            self.locks.nudge(transaction.session_id)

    def expired(self, now: float) -> list[Transaction]:
        """The open transactions older than the lifetime (the reaper aborts them)."""
        return [t for t in self._open.values() if t.aborted is None and now - t.started > self.lifetime]


def _name(key: LockKey) -> str:
    database, collection, storage_key = key
    return f"document {_shown(storage_key)} of {database}.{collection}"


def _shown(storage_key: Hashable) -> str:
    # mongoeco's storage keys are (type, value) pairs: show the value.
    value = storage_key[1] if isinstance(storage_key, tuple) and len(storage_key) == 2 else storage_key
    return repr(value)[:80]
