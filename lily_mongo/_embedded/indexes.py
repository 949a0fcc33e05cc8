"""Lookups through mongoeco's own index structures where its memory engine scans a collection.

mongoeco keeps each collection in a persistent hash map keyed by the ``_id``'s
storage key, and each secondary index as a persistent hash map from index key to
members (``MemoryIndexMap``). Its planner uses them for an equality on ``_id`` that
finds its document and for an equality on a single-field index; everything else
walks the whole collection. Three of those walks are what lily's commands hit, each
costing time in proportion to the collection (docs/emulator.md, "The corrections"):

* **every single-document insert** compares its ``_id`` with every stored ``_id``
  (``scan_payload_id``): BSON equality holds 1, 1.0 and Decimal128("1") equal, which
  storage keys do not. For an ``_id`` with no number and no binary value in it
  (lily's string keys, ObjectIds, UUIDs, dates, documents of those) the storage key
  *is* its BSON equality class, so the hash map answers alone
  (:func:`plain_id`);
* **a lookup of an ``_id`` that is not there** (the first claim of a new event, an
  upsert) falls through to a walk of the collection; for a plain ``_id`` the hash
  map's "absent" is the answer;
* **``_id: {$in: [...]}``** (the outbox's claims and marks, ``update_many`` by
  ``_id``) is never looked up: each listed ``_id`` is, here, and the candidates are
  put in natural order (O(n log N) for n ``_id``\\ s in N documents);
* **a query that implies a partial index's filter** (the relay's ``status:
  "pending"`` against ``lily_outbox_due``) walks the whole collection; here it walks
  the index's members, which are the only documents that can match.

Numeric and binary ``_id``\\ s keep mongoeco's walk (their equality classes are not
storage keys): a remaining deviation, named in docs/emulator.md.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

from mongoeco.core.bson_scalars import is_bson_numeric
from mongoeco.core.identity import document_matches_root_id_lookup, is_valid_root_document_id
from mongoeco.core.query_plan import AndCondition, EqualsCondition, InCondition, QueryNode
from mongoeco.engines._memory_collection import MemoryCollection, MemoryIndexMap
from mongoeco.engines.virtual_indexes import is_virtual_index, query_can_use_index

__all__ = ["candidate_items", "plain_id"]

Item = tuple[Hashable, Any]


def plain_id(value: object) -> bool:
    """True when ``value``'s storage key is its BSON equality class: no number and no binary value in it.

    A null ``_id`` also matches documents without one, and an array or a regular
    expression is no ``_id`` at all: those stay on mongoeco's path too.
    """
    return value is not None and is_valid_root_document_id(value) and _plain(value)


def _plain(value: object) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, bytes) or is_bson_numeric(value):  # BSON binary values derive from bytes
        return False
    if isinstance(value, dict):
        return all(map(_plain, value.values()))
    if isinstance(value, list | tuple):
        return all(map(_plain, value))
    return True


def _id_values(plan: QueryNode) -> tuple[object, ...] | None:
    """The ``_id``\\ s a query is restricted to (an equality or ``$in`` on ``_id``, alone or in an ``$and``)."""
    clauses = plan.clauses if isinstance(plan, AndCondition) else (plan,)
    for clause in clauses:
        if isinstance(clause, EqualsCondition) and clause.field == "_id":
            return (clause.value,)
        if isinstance(clause, InCondition) and clause.field == "_id":
            return clause.values
    return None


def _in_natural_order(coll: MemoryCollection[Any, Any], keys: Iterable[Hashable], limit: int | None) -> list[Item]:
    ordered = coll.ordered_keys(keys, limit=limit)
    return [(key, coll[key]) for key in ordered]


def _by_id(
    engine: Any, coll: MemoryCollection[Any, Any], values: tuple[object, ...], dialect: Any, limit: int | None
) -> list[Item]:
    keys = set()
    for value in values:
        key = engine._storage_key(value)
        data = coll.get(key)
        # mongoeco's own check on a found document (a stored document without an _id matches any).
        if data is not None and document_matches_root_id_lookup(
            engine._borrow_public_storage_document(data), value, dialect=dialect
        ):
            keys.add(key)
    return _in_natural_order(coll, keys, limit)


def _partial_index_members(
    indexes: list[Any], index_data: dict[str, Any], plan: QueryNode, *, dialect: Any, collation: Any
) -> set[Hashable] | None:
    """The members of the smallest partial (or sparse) index every match of ``plan`` is in, if any."""
    best: set[Hashable] | None = None
    for index in indexes:
        if not is_virtual_index(index) or not query_can_use_index(index, plan, dialect=dialect, collation=collation):
            continue
        index_map = index_data.get(index.name)
        if not isinstance(index_map, MemoryIndexMap):
            continue
        members: set[Hashable] = set()
        for bucket_key in index_map:
            members.update(index_map[bucket_key])
        if best is None or len(members) < len(best):
            best = members
    return best


def candidate_items(
    engine: Any,
    coll: object,
    plan: QueryNode,
    *,
    dialect: Any,
    indexes: list[Any],
    index_data: dict[str, Any],
    collation: Any,
    natural_order_limit: int | None,
) -> list[Item] | None:
    """The documents that can match ``plan``, in natural order, found without a walk; None: mongoeco's way.

    A superset of the matches: the caller still applies the whole filter.
    """
    if not isinstance(coll, MemoryCollection):
        return None
    values = _id_values(plan)
    if values is not None and all(map(plain_id, values)):
        return _by_id(engine, coll, values, dialect, natural_order_limit)
    if values is not None or collation is not None:
        return None
    if (
        engine._indexed_candidate_storage_keys_for_plan_locked(
            indexes, index_data, plan, dialect=dialect, collation=collation
        )
        is not None
    ):
        return None  # an equality on a single-field index: mongoeco's own lookup
    members = _partial_index_members(indexes, index_data, plan, dialect=dialect, collation=collation)
    if members is None:
        return None
    return _in_natural_order(coll, members, natural_order_limit)
