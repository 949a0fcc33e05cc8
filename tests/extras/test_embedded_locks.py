"""The embedded server's document locks and transaction book, without a server (docs/emulator.md).

A transaction's first write to a document takes its lock; a second transaction
writing it is refused at once (WriteConflict), a write outside any transaction
waits for the release within its deadline; a transaction never waits.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("mongoeco")

from lily_mongo._embedded.errors import Refusal
from lily_mongo._embedded.locks import DocumentLocks
from lily_mongo._embedded.transactions import ABSENT, TransactionBook

DOC = ("db", "coll", ("str", "a"))
VERSION = object()


def session(name: str) -> SimpleNamespace:
    return SimpleNamespace(session_id=name, transaction_active=True)


def refused_code(refusal: Refusal) -> int:
    # mongoeco's OperationFailure sets its code and labels at run time, undeclared for a type checker.
    return int(getattr(refusal.error, "code"))  # noqa: B009


def refused_labels(refusal: Refusal) -> tuple[str, ...]:
    return tuple(getattr(refusal.error, "error_labels"))  # noqa: B009


def test_the_first_writer_holds_and_a_second_transaction_is_refused_at_once() -> None:
    book = TransactionBook()
    one, two = book.begin(session("one")), book.begin(session("two"))
    book.admit(one, DOC, VERSION, VERSION)
    held = book.locks.holder(DOC)
    assert held is not None
    assert held.owner == "one"
    book.admit(one, DOC, VERSION, VERSION)  # its own document again: no conflict
    with pytest.raises(Refusal) as caught:
        book.admit(two, DOC, VERSION, VERSION)
    assert refused_code(caught.value) == 112
    assert refused_labels(caught.value) == ("TransientTransactionError",)
    assert two.aborted is not None  # the refused transaction is aborted, as on MongoDB
    with pytest.raises(Refusal) as again:
        book.admit(two, ("db", "coll", ("str", "b")), ABSENT, ABSENT)
    assert refused_code(again.value) == 251  # NoSuchTransaction from now on


def test_a_document_changed_after_the_snapshot_is_refused() -> None:
    book = TransactionBook()
    late = book.begin(session("late"))
    with pytest.raises(Refusal) as caught:
        book.admit(late, DOC, VERSION, object())  # the live version is another one
    assert refused_code(caught.value) == 112
    assert book.locks.holder(DOC) is None


def test_ending_a_transaction_releases_its_documents() -> None:
    book = TransactionBook()
    one = book.begin(session("one"))
    book.admit(one, DOC, VERSION, VERSION)
    book.end("one")
    two = book.begin(session("two"))
    book.admit(two, DOC, VERSION, VERSION)
    held = book.locks.holder(DOC)
    assert held is not None
    assert held.owner == "two"


async def test_a_waiter_wakes_at_the_release_or_gives_up_at_its_deadline() -> None:
    locks = DocumentLocks()
    lock = locks.take(DOC, "one")
    started = time.monotonic()
    assert await DocumentLocks.wait(lock, time.monotonic() + 0.1) is False
    assert 0.1 <= time.monotonic() - started < 1.0
    waiting = asyncio.create_task(DocumentLocks.wait(lock, time.monotonic() + 5))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    assert locks.release_all("one") == 1
    assert await waiting is True
    assert locks.holder(DOC) is None


async def test_a_yielding_holder_is_taken_over_once_no_command_of_it_runs() -> None:
    book = TransactionBook()
    holder = book.begin(session("holder"))
    book.admit(holder, DOC, VERSION, VERSION)
    holder.running = 1  # a commit of it in progress
    book.mark_yielding(holder)
    assert book.take_over("holder") is False
    lock = book.locks.holder(DOC)
    assert lock is not None
    waiting = asyncio.create_task(DocumentLocks.wait(lock, None))
    await asyncio.sleep(0)
    book.command_ended(holder)  # its commit failed with an unknown outcome: the waiter looks again
    assert await asyncio.wait_for(waiting, 1) is True
    assert book.take_over("holder") is True
    assert holder.aborted is not None
    assert book.locks.holder(DOC) is None


def test_transactions_older_than_the_lifetime_are_the_reapers() -> None:
    book = TransactionBook(lifetime=1.0)
    old = book.begin(session("old"))
    book.begin(session("young"))
    old.started -= 2.0
    assert book.expired(time.monotonic()) == [old]
    book.abort(old, "it exceeded transactionLifetimeLimitSeconds")
    assert book.expired(time.monotonic()) == []
    refusal = book.refusal("old")
    assert refusal is not None
    assert refused_code(refusal) == 251
    assert book.refusal("young") is None
