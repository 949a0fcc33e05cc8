"""A handler's MongoScope and an OutboxTransaction: their parts while open, ScopeClosedError once closed."""

from __future__ import annotations

from typing import Any

import pytest

from lily_mongo import MongoScope, OutboxTransaction, ScopeClosedError

SESSION: Any = object()
DATABASE: Any = object()


def test_a_mongo_scope_gives_its_parts_until_its_attempt_ends() -> None:
    outbox: Any = object()
    scope = MongoScope(SESSION, DATABASE, outbox)
    assert (scope.is_open, scope.session, scope.database, scope.outbox) == (True, SESSION, DATABASE, outbox)
    scope.close()
    assert not scope.is_open
    for part in ("session", "database", "outbox"):
        with pytest.raises(ScopeClosedError, match="belongs to a finished attempt"):
            getattr(scope, part)


async def test_an_outbox_transaction_refuses_its_session_and_publishing_once_ended() -> None:
    writer: Any = object()  # never reached: the closed transaction refuses first
    tx = OutboxTransaction(SESSION, DATABASE, writer)
    assert (tx.is_open, tx.session, tx.database) == (True, SESSION, DATABASE)
    tx.close()
    assert not tx.is_open
    with pytest.raises(ScopeClosedError, match="this transaction has ended"):
        _ = tx.database
    with pytest.raises(ScopeClosedError, match="this transaction has ended"):
        await tx.publish_text("orders", "placed", version=1)
