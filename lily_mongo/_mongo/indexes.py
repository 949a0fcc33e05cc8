"""Indexes the inbox and the outbox create, or only verify in passive mode."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pymongo.errors import (
    OperationFailure,
)

from .._errors import ConfigError

if TYPE_CHECKING:
    from pymongo.asynchronous.collection import AsyncCollection


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
