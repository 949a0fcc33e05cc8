"""A transaction's commit, document by document (MongoDB's rule, docs/emulator.md
"The corrections").

mongoeco commits a transaction by installing its copies of the collections it
touched over the live ones, and so refuses it whenever anything at all was written
since its snapshot. Here the commit applies only the documents the transaction
wrote (:class:`.transactions.Transaction` ``written``), each over the live
collection, with the live collection's indexes kept in step; it is refused (with
WriteConflict) only when one of those documents is no longer the version the
transaction wrote over, or when a new version would break a unique index of the live
collection. Every check runs before the first change, and nothing between them
awaits: the commit is atomic to every other command.
"""

from __future__ import annotations

from typing import Any

from mongoeco.engines._memory_collection import MemoryCollection
from mongoeco.errors import DuplicateKeyError

from .transactions import ABSENT, Transaction, TransactionBook

__all__ = ["merge"]


def merge(engine: Any, state: Any, transaction: Transaction, book: TransactionBook) -> None:
    """Apply ``transaction``'s writes (its MVCC ``state``) to ``engine``'s live collections, or refuse.

    Called under the engine's meta lock, in place of mongoeco's install of the
    transaction's roots; the caller forgets the transaction afterwards.
    """
    changes: list[tuple[str, str, Any, Any, Any]] = []
    for key, version_before in transaction.written.items():
        database, collection, storage_key = key
        version = _version(state.storage, database, collection, storage_key)
        if version is version_before:
            continue  # written and rolled back (a failed write), or written back as it was
        live = _version(engine._storage, database, collection, storage_key)
        if live is not version_before:  # only a path outside the document locks can do this (a drop)
            raise book.conflict(transaction, f"{database}.{collection} changed under the transaction")
        changes.append((database, collection, storage_key, live, version))
    for database, collection, storage_key, _, version in changes:
        if version is ABSENT:
            continue
        try:
            engine._ensure_unique_indexes(
                database,
                collection,
                engine._borrow_storage_document(version),
                exclude_storage_key=storage_key,
                storage_view=engine._storage,
                **_live_indexes(engine),
            )
        except DuplicateKeyError as exc:
            raise book.conflict(transaction, f"a unique index of {database}.{collection}: {exc}") from None

    for database, collection, storage_key, live, version in changes:
        target = _live_collection(engine, state, database, collection)
        if live is not ABSENT:
            _index(engine, database, collection, storage_key, live, "delete")
        if version is ABSENT:
            del target[storage_key]
        else:
            target[storage_key] = version
            _index(engine, database, collection, storage_key, version, "insert")

    sequence, committed, pruned = engine._prepare_committed_changes_locked(state.pending_changes)
    engine._commit_sequence = sequence
    engine._committed_changes = committed
    engine._change_pruned_through = pruned
    engine._mvcc_version += 1  # what mongoeco's own commit path checks (a transaction that changed definitions)
    engine._invalidate_transaction_search_runtime_cache(state)


def _version(storage: dict[str, Any], database: str, collection: str, storage_key: Any) -> Any:
    documents = storage.get(database, {}).get(collection)
    return ABSENT if documents is None else documents.get(storage_key, ABSENT)


def _live_collection(engine: Any, state: Any, database: str, collection: str) -> Any:
    """The live collection, created (with the options the transaction gave it) if the transaction made it."""
    documents = engine._storage.setdefault(database, {}).get(collection)
    if documents is None:
        documents = engine._storage[database].setdefault(collection, MemoryCollection())
        options = state.collection_options.get(database, {}).get(collection)
        engine._register_collection_locked(database, collection, options=options)
    return documents


def _index(engine: Any, database: str, collection: str, storage_key: Any, version: Any, action: str) -> None:
    engine._update_indexes_locked(
        database,
        collection,
        storage_key,
        engine._borrow_storage_document(version),
        action=action,
        **_live_indexes(engine),
    )


def _live_indexes(engine: Any) -> dict[str, Any]:
    """The live collections' index definitions and entries, as mongoeco's index checks and updates take them."""
    return {"indexes_view": engine._indexes, "index_data_view": engine._index_data}
