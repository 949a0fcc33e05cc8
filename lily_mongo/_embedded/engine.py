"""mongoeco's memory engine with MongoDB's write conflicts, document locks and transaction lifetime.

A subclass of the engine, made for the one server process that runs it (nothing of
mongoeco's is changed for anyone else). It keeps mongoeco's MVCC (every transaction
reads its snapshot) and changes what happens around a write and a commit
(docs/emulator.md, "The corrections"):

* every document write passes through mongoeco's two storage primitives, which this
  class overrides to decide first (:meth:`LilyMemoryEngine._admit`): a write that
  changes nothing writes nothing (MongoDB's no-op update, ``$setOnInsert`` on an
  existing document among them); a transaction's write takes the document's lock
  or fails with WriteConflict (:class:`.transactions.TransactionBook`); a write
  outside any transaction to a held document signals :class:`.errors.Held`, and its
  command (:meth:`LilyMemoryEngine._waiting`) waits for the holder, within its
  ``maxTimeMS``, then runs again from the start (mongoeco rolls the attempt back);
* a commit applies the transaction's documents one by one (:mod:`.commit`); a
  transaction that changed a collection's definition keeps mongoeco's own commit;
* TTL deletion never runs inside a transaction (on MongoDB a background task
  deletes expired documents outside any transaction) and waits while an expired
  document is held;
* the lookups of :mod:`.indexes` replace three collection walks.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

from mongoeco.engines.memory import MemoryEngine
from mongoeco.errors import OperationFailure

from . import commit, indexes
from .errors import Held, Refusal, max_time_expired
from .locks import DocumentLocks, command_deadline
from .transactions import ABSENT, Transaction, TransactionBook

__all__ = ["LilyMemoryEngine"]

T = TypeVar("T")

# Engine calls that change a collection's definition: inside a transaction they make its
# commit take mongoeco's own path.
_DEFINITIONS = (
    "create_index",
    "drop_index",
    "drop_indexes",
    "create_collection",
    "drop_collection",
    "rename_collection",
    "drop_database",
    "create_search_index",
    "update_search_index",
    "drop_search_index",
)


class LilyMemoryEngine(MemoryEngine):
    """The memory engine of the embedded server (see the module docstring)."""

    def __init__(self, transactions: TransactionBook, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.transactions = transactions  # begun and ended by the wire layer's sessions (.commands)

    # -- transactions ------------------------------------------------------------------------------

    def _abort_session_transaction(self, session: Any) -> None:
        try:
            super()._abort_session_transaction(session)
        finally:
            self.transactions.locks.release_all(session.session_id)

    def _commit_session_transaction(self, session: Any) -> None:
        book = self.transactions
        transaction = book.get(session.session_id)
        if transaction is None:
            super()._commit_session_transaction(session)
            return
        refusal = book.refusal(session.session_id)
        if refusal is not None:
            raise refusal
        if transaction.whole:
            self._commit_whole(session, transaction)
            return
        with self._meta_lock:
            self._ensure_publication_boundary()
            state = self._mvcc_states.get(session.session_id)
            if state is not None:
                commit.merge(self, state, transaction, book)
                self._mvcc_states.pop(session.session_id, None)
        book.end(session.session_id)
        self._sync_session_state(session, transaction_active=False, snapshot_version=self._mvcc_version)

    def _commit_whole(self, session: Any, transaction: Transaction) -> None:
        """mongoeco's own commit (its global rule), its refusal in MongoDB's shape."""
        try:
            super()._commit_session_transaction(session)
        except OperationFailure as exc:
            if "Write conflict" not in str(exc):
                raise
            raise self.transactions.conflict(
                transaction, "written since the snapshot of a transaction that changed a definition"
            ) from None
        self.transactions.end(session.session_id)

    def _transaction_of(self, storage: object) -> Transaction | None:
        for session_id, state in self._mvcc_states.items():
            if state.storage is storage:
                return self.transactions.get(session_id)
        return None

    # -- every document write ----------------------------------------------------------------------

    def _set_storage_document_locked(self, collection: Any, storage_key: Any, document: Any) -> None:
        if self._admit(collection, storage_key, document):
            super()._set_storage_document_locked(collection, storage_key, document)

    def _delete_storage_document_locked(self, collection: Any, storage_key: Any) -> None:
        if self._admit(collection, storage_key, None):
            super()._delete_storage_document_locked(collection, storage_key)

    def _admit(self, collection: Any, storage_key: Hashable, version: Any) -> bool:
        """May this write go ahead? False: it changes nothing, skip it. Raises a refusal or :class:`Held`."""
        current = collection.get(storage_key, ABSENT)
        if version is not None and current is not ABSENT and _same(current, version):
            return False
        target = self._target(collection)
        if target is None:
            return True  # a write outside mongoeco's document journal: its own rules
        database, name, storage = target
        key = (database, name, storage_key)
        if storage is self._storage:
            lock = self.transactions.locks.holder(key)
            if lock is not None and not self.transactions.take_over(lock.owner):
                raise Held(lock)
            return True
        transaction = self._transaction_of(storage)
        if transaction is not None:
            live = self._storage.get(database, {}).get(name)
            live_version = ABSENT if live is None else live.get(storage_key, ABSENT)
            self.transactions.admit(transaction, key, current, live_version)
        return True

    def _target(self, collection: Any) -> tuple[str, str, Any] | None:
        """The namespace and storage root of the collection being written (mongoeco's open journals say)."""
        for journal in reversed(self._document_undo_stack):
            if journal.storage.get(journal.db_name, {}).get(journal.coll_name) is collection:
                return journal.db_name, journal.coll_name, journal.storage
        return None

    async def _waiting(self, operation: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """Run a write; while it finds a held document, wait for it (within ``maxTimeMS``) and run it again."""
        while True:
            try:
                return await operation(*args, **kwargs)
            except Held as held:
                if not await DocumentLocks.wait(held.lock, command_deadline.get()):
                    raise Refusal(max_time_expired()) from None

    async def insert_document(self, *args: Any, **kwargs: Any) -> Any:
        return await self._waiting(super().insert_document, *args, **kwargs)

    async def insert_documents(self, *args: Any, **kwargs: Any) -> Any:
        return await self._waiting(super().insert_documents, *args, **kwargs)

    async def update_with_operation(self, *args: Any, **kwargs: Any) -> Any:
        replacement = kwargs.get("replacement_document")
        if replacement is not None and not indexes.plain_id(replacement.get("_id", "")):
            # A replacement may change a numeric _id's type, which moves the document to another
            # storage key behind the storage primitives: such a transaction commits whole.
            self._commit_whole_if_in_transaction(kwargs.get("context"), kwargs.get("operation_context"))
        return await self._waiting(super().update_with_operation, *args, **kwargs)

    async def delete_with_operation(self, *args: Any, **kwargs: Any) -> Any:
        return await self._waiting(super().delete_with_operation, *args, **kwargs)

    async def delete_document(self, *args: Any, **kwargs: Any) -> Any:
        return await self._waiting(super().delete_document, *args, **kwargs)

    async def merge_document(self, *args: Any, **kwargs: Any) -> Any:
        return await self._waiting(super().merge_document, *args, **kwargs)

    def _commit_whole_if_in_transaction(self, context: Any, operation_context: Any = None) -> None:
        session = operation_context.session if operation_context is not None else context
        if session is not None and session.in_transaction:
            transaction = self.transactions.get(session.session_id)
            if transaction is not None:
                transaction.whole = True

    # -- TTL deletion ------------------------------------------------------------------------------

    def _purge_expired_documents_locked(self, db_name: str, coll_name: str, **kwargs: Any) -> int:
        context = kwargs.get("context")
        storage = kwargs.get("storage_view")
        if (context is not None and context.in_transaction) or (storage is not None and storage is not self._storage):
            return 0
        if len(self.transactions.locks) and self._expired_document_held(db_name, coll_name, kwargs["now"]):
            return 0  # deleted by a later command, once no transaction holds it
        result: int = super()._purge_expired_documents_locked(db_name, coll_name, **kwargs)
        return result

    def _expired_document_held(self, db_name: str, coll_name: str, now: Any) -> bool:
        locks = self.transactions.locks
        for index_map in self._index_data.get(db_name, {}).get(coll_name, {}).values():
            expired = getattr(index_map, "expired_storage_keys", None)
            if expired is not None and any(locks.holder((db_name, coll_name, key)) for key in expired(now)):
                return True
        return False

    # -- lookups -----------------------------------------------------------------------------------

    def _ensure_unique_indexes(self, db_name: str, coll_name: str, candidate: Any, **kwargs: Any) -> None:
        if kwargs.get("scan_payload_id") and indexes.plain_id(candidate.get("_id")):
            kwargs["scan_payload_id"] = False  # the storage key is the _id's equality class (indexes.plain_id)
        super()._ensure_unique_indexes(db_name, coll_name, candidate, **kwargs)

    def _candidate_items_for_plan_locked(self, coll: Any, query_plan: Any, **kwargs: Any) -> Any:
        found = indexes.candidate_items(
            self,
            coll,
            query_plan,
            dialect=kwargs["dialect"],
            indexes=kwargs["indexes"],
            index_data=kwargs["index_data"],
            collation=kwargs.get("collation"),
            natural_order_limit=kwargs.get("natural_order_limit"),
        )
        return found if found is not None else super()._candidate_items_for_plan_locked(coll, query_plan, **kwargs)

    async def disconnect(self) -> None:
        await super().disconnect()
        if not self._connection_count:  # mongoeco dropped every snapshot: no transaction holds anything
            for transaction in self.transactions:
                self.transactions.end(transaction.session_id)


def _definition_call(name: str) -> Callable[..., Awaitable[Any]]:
    original = getattr(MemoryEngine, name)

    async def call(self: LilyMemoryEngine, *args: Any, **kwargs: Any) -> Any:
        self._commit_whole_if_in_transaction(kwargs.get("context"))
        return await original(self, *args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"mongoeco's ``{name}``; inside a transaction its commit takes mongoeco's own path."
    return call


for _name in _DEFINITIONS:
    setattr(LilyMemoryEngine, _name, _definition_call(_name))


def _same(stored: Any, version: Any) -> bool:
    """The two stored versions hold the same document, field order and BSON types included."""
    return _identical(getattr(stored, "payload", stored), getattr(version, "payload", version))


def _identical(a: object, b: object) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return len(a) == len(b) and all(
            ka == kb and _identical(va, vb) for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
        )
    if isinstance(a, list):
        assert isinstance(b, list)
        return len(a) == len(b) and all(map(_identical, a, b))
    return a == b
