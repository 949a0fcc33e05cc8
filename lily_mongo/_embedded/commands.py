"""The wire layer's part: each command's deadline, refusals in MongoDB's shape, transactions per session.

mongoeco's command executor and session store, subclassed for the one server that
uses them (docs/emulator.md):

* every command runs with its ``maxTimeMS`` as the deadline of any wait for a
  document (:data:`.locks.command_deadline`), and a :class:`.errors.Refusal` the
  engine raised becomes the command's top-level error reply;
* a command of a transaction the server aborted (a write conflict, its age) fails
  with NoSuchTransaction, as on MongoDB, until the session aborts it or starts
  another;
* a failed command aborts its transaction, as MongoDB's service entry point does
  (inside a transaction a write error is the command's error); a commit whose
  outcome is unknown, or whose connection closed on it, leaves it open but yielding
  (:mod:`.transactions`);
* ``startTransaction`` on a session whose transaction is still open aborts that
  one first (MongoDB's rule for a new transaction number; mongoeco would carry the
  old transaction's writes into the new one);
* ``killSessions`` aborts the named sessions' open transactions at once (their
  documents released, their next command refused), as MongoDB's does for a
  transaction that is not prepared; mongoeco does not know the command;
* ``getParameter`` / ``setParameter`` (:mod:`.parameters`), ``hello``
  (:mod:`.handshake`) and retryable writes (:mod:`.retries`);
* on request (``majority_latency``), a replica set's wait for the majority: a
  commit, and a write outside a transaction acknowledged by more than the primary
  (MongoDB's default write concern is the majority), answers that many seconds
  after it applied. Off by default: a model for benchmarks, not a deviation fixed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from mongoeco.errors import InvalidOperation, OperationFailure
from mongoeco.wire._session_identity import wire_session_key
from mongoeco.wire.executor import WireCommandExecutor
from mongoeco.wire.sessions import WireSessionStore

from . import parameters
from .errors import Held, Refusal, write_conflict
from .handshake import ReplicaSetHandlers
from .locks import command_deadline
from .retries import RetryableWrites
from .transactions import TransactionBook

__all__ = ["COMMANDS", "LilyCommandExecutor", "LilySessionStore"]

KILL_SESSIONS = "killSessions"
COMMANDS = (*parameters.COMMANDS, KILL_SESSIONS)  # the commands this layer answers that mongoeco does not

_UNKNOWN_COMMIT = "UnknownTransactionCommitResult"
# The SQLite engine's answer to a second concurrent transaction (docs/emulator.md, "The SQLite engine").
_ENGINE_BUSY = "already has an active transaction"
_WRITES = frozenset({"insert", "update", "delete", "findAndModify"})


class LilySessionStore(WireSessionStore):
    """mongoeco's sessions, with MongoDB's transaction numbering and the transaction book kept in step."""

    def __init__(self, book: TransactionBook) -> None:
        super().__init__()
        self._book = book

    def _apply_transaction_metadata(self, session: Any, body: dict[str, Any]) -> None:  # type: ignore[override]
        # (a static method in mongoeco, called through the store: this one needs the book)
        if body.get("startTransaction") is not True:
            WireSessionStore._apply_transaction_metadata(session, body)
            return
        if session.transaction_active:
            session.abort_transaction()  # a new transaction number aborts the open transaction
        self._book.end(session.session_id)
        try:
            WireSessionStore._apply_transaction_metadata(session, body)
        except InvalidOperation as exc:
            if _ENGINE_BUSY not in str(exc):
                raise
            raise write_conflict("the SQLite engine runs one transaction at a time; another is open") from None
        self._book.begin(session)

    def commit_transaction(self, body: dict[str, Any]) -> dict[str, Any]:
        reply: dict[str, Any] = super().commit_transaction(body)
        self._book.end(self._require_session(body).session_id)
        return reply

    def abort_transaction(self, body: dict[str, Any]) -> dict[str, Any]:
        session = self._require_session(body)
        try:
            reply: dict[str, Any] = super().abort_transaction(body)
        finally:
            self._book.end(session.session_id)
        return reply

    def end_sessions(self, session_specs: object) -> dict[str, Any]:
        ending = (
            [self._sessions.get(wire_session_key(spec)) for spec in session_specs or ()]
            if isinstance(session_specs, list)
            else []
        )
        reply: dict[str, Any] = super().end_sessions(session_specs)
        for context in ending:
            if context is not None:
                self._book.end(context.session.session_id)
        return reply

    def kill_sessions(self, session_specs: object, book: TransactionBook) -> dict[str, Any]:
        """``killSessions``: abort each named session's open transaction (an empty list names none here:
        MongoDB's would kill every session of the user, which no client of this server asks for)."""
        if not isinstance(session_specs, list):
            raise OperationFailure("killSessions must be a list", code=14, details={"codeName": "TypeMismatch"})
        for spec in session_specs:
            context = self._sessions.get(wire_session_key(spec))
            if context is None:
                continue
            transaction = book.get(context.session.session_id)
            if transaction is not None:
                book.abort(transaction, "its session was killed (killSessions)")
            if (transaction is None or not transaction.running) and context.session.transaction_active:
                context.session.abort_transaction()
        return {"ok": 1.0}


class LilyCommandExecutor(WireCommandExecutor):
    """mongoeco's command executor with the rules of the module docstring."""

    def __init__(
        self,
        client: Any,
        cursor_store: Any,
        session_store: LilySessionStore,
        *,
        surface: Any,
        auth: Any,
        book: TransactionBook,
        member: Callable[[Any], str] | None,
        majority_latency: float = 0.0,
    ) -> None:
        parts = {"client": client, "cursor_store": cursor_store, "session_store": session_store}
        super().__init__(**parts, surface=surface, auth=auth)
        self._book = book
        self._majority_latency = majority_latency
        if member is not None:  # hello as a replica set's primary (.handshake)
            self._handlers = ReplicaSetHandlers(**parts, surface=surface, auth=auth, member=member)
        self._auth_service = auth
        self._sessions = session_store
        self._writes = RetryableWrites()

    async def execute_prepared(self, context: Any) -> dict[str, Any]:
        name = context.command_name
        if name in parameters.COMMANDS:
            self._auth_service.require_authenticated(context.connection, name)
            return parameters.answer(context, self._book)
        if name == KILL_SESSIONS:
            self._auth_service.require_authenticated(context.connection, name)
            return self._sessions.kill_sessions(context.command_document[name], self._book)
        session = context.session
        transaction = None
        if session is not None and context.raw_body.get("autocommit") is False:
            if name != "abortTransaction":
                refusal = self._book.refusal(session.session_id)
                if refusal is not None:
                    raise refusal.error
            transaction = self._book.get(session.session_id)
        if transaction is not None:
            transaction.running += 1
            transaction.connection = (context.connection.peer_host, context.connection.peer_port)
        token = command_deadline.set(_deadline(context.command_document))
        try:
            key = self._writes.key(context)
            reply = await (self._run(context) if key is None else self._writes.run(key, lambda: self._run(context)))
            if transaction is not None and reply.get("writeErrors"):
                # Inside a transaction MongoDB answers a write error as the command's error, and aborts.
                self._abort(session, f"its {name} failed with a write error")
            if self._majority_latency > 0 and waits_for_majority(
                name, context.raw_body, in_transaction=transaction is not None
            ):
                await asyncio.sleep(self._majority_latency)
            return reply
        except Exception as exc:
            if transaction is not None and name != "abortTransaction":
                if isinstance(exc, OperationFailure) and _ends_transaction(exc):
                    self._abort(session, f"its {name} failed with code {getattr(exc, 'code', None)}")
                elif name == "commitTransaction":
                    # An unknown outcome, or the connection closed on it: the client may retry the
                    # commit, or give the transaction up (.transactions, "yields").
                    self._book.mark_yielding(transaction)
            raise
        finally:
            command_deadline.reset(token)
            if transaction is not None:
                self._book.command_ended(transaction)

    def _abort(self, session: Any, reason: str) -> None:
        """MongoDB aborts a transaction one of whose commands failed: its documents are released now."""
        transaction = self._book.get(session.session_id)
        if transaction is not None:
            self._book.abort(transaction, reason)
        if session.transaction_active:
            session.abort_transaction()

    async def _run(self, context: Any) -> dict[str, Any]:
        try:
            result: dict[str, Any] = await super().execute_prepared(context)
        except Refusal as refusal:
            raise refusal.error from None
        except Held:  # a held document met on a path the engine does not wait on: MongoDB's answer there
            raise write_conflict("the document is held by a transaction") from None
        return result


def waits_for_majority(name: str, body: dict[str, Any], *, in_transaction: bool) -> bool:
    """Whether a replica set's primary would answer ``name`` only once a majority has it: a commit, or
    a write outside a transaction whose write concern asks more than the primary (``w`` absent: the
    default, the majority)."""
    if name == "commitTransaction":
        return True
    if name not in _WRITES or in_transaction:
        return False
    concern = body.get("writeConcern")
    w = concern.get("w") if isinstance(concern, dict) else None
    return not (isinstance(w, int) and not isinstance(w, bool) and w <= 1)


def _ends_transaction(error: OperationFailure) -> bool:
    """A failed command aborts its transaction, except a commit whose outcome is unknown (it is retried)."""
    labels = getattr(error, "error_labels", ())
    return _UNKNOWN_COMMIT not in labels and "RetryableWriteError" not in labels


def _deadline(command: dict[str, Any]) -> float | None:
    limit = command.get("maxTimeMS")
    if isinstance(limit, bool) or not isinstance(limit, int | float) or limit <= 0:
        return None
    return time.monotonic() + limit / 1000
