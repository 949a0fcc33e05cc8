"""One transaction skeleton for the inbox and ``Outbox.transaction`` (docs/inbox.md, docs/outbox.md).

PyMongo's ``with_transaction`` keeps it in one method; here its steps stand apart, so that each
caller bounds them by its own deadline:

* :func:`start_transaction`: a fresh session (no causal consistency) and a snapshot transaction
  whose commit is majority-acknowledged;
* :func:`replaying`: run an attempt; a :class:`Replay` it raises (a ``TransientTransactionError``,
  or a commit that did not apply) runs it again in a fresh transaction after a jittered backoff,
  within the replay budget and whatever else the caller's ``stop`` says;
* :func:`commit`: the first commit, classified by its labels: committed, replay, or unknown;
* :func:`retry_commit`: after an unknown result, the same commit again (bounded, two separate
  loops as in PyMongo: the callback is never re-run to find out);
* :func:`read_back` and :func:`read_back_verdict`: still unknown, the transaction's own record is
  read with majority read concern from the primary, and decides (:func:`read_backs`: the records of
  a batch's transaction, in one read);
* :func:`abort_quietly`: an abort that never raises (a failed abort drops the server session).

Its rules (what an error's labels mean, how many replays, what the record read back says) are
the pure functions of :mod:`.rules`, called through that module.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import pymongo
from pymongo import ReadPreference
from pymongo.errors import PyMongoError
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from .._tasks import raise_if_cancel_requested
from . import rules
from .errors import error_labels
from .rules import NO_DEADLINE, Deadline, ErrorStep, Rules
from .sessions import discard_server_session

if TYPE_CHECKING:
    from pymongo import AsyncMongoClient
    from pymongo.asynchronous.client_session import AsyncClientSession
    from pymongo.asynchronous.collection import AsyncCollection

__all__ = [
    "Replay",
    "abort_quietly",
    "commit",
    "majority_reads",
    "read_back",
    "read_backs",
    "replaying",
    "retry_commit",
    "start_transaction",
]


class Replay(Exception):
    """The attempt must be replayed in a fresh transaction (a transient error, or a commit not applied)."""

    error_type = "transient_replay"  # what an attempt's span reports
    handler_error: BaseException | None = None  # what the handler raised, when the replay came from it


# -- the skeleton ------------------------------------------------------------------------------------


async def start_transaction(client: AsyncMongoClient[Any]) -> AsyncClientSession:
    """A fresh session with a snapshot transaction started; the caller ends the session."""
    session = client.start_session(causal_consistency=False)
    try:
        await session.start_transaction(read_concern=ReadConcern("snapshot"), write_concern=WriteConcern("majority"))
    except BaseException:
        await session.end_session()
        raise
    return session


async def replaying[T](
    attempt: Callable[[], Awaitable[T]],
    policy: Rules,
    *,
    spent: Callable[[Replay, int], T],
    stop: Callable[[Replay, int], Awaitable[T | None]] | None = None,
    replays: int = 0,
) -> T:
    """Run ``attempt`` until it returns; each :class:`Replay` it raises counts one more replay (from
    ``replays``, what an earlier loop of the same delivery counted), then ``stop`` may end it with a
    verdict, then past the budget ``spent`` gives one (or raises); else a jittered backoff and again."""
    while True:
        try:
            return await attempt()
        except Replay as replay:
            replays += 1
            if stop is not None:
                verdict = await stop(replay, replays)
                if verdict is not None:
                    return verdict
            if rules.next_after_replay(replays, policy.replay_budget) is ErrorStep.DEFER:
                return spent(replay, replays)
            raise_if_cancel_requested()  # cancelled while the attempt ignored it: no replay
            await asyncio.sleep(policy.backoff(replays))


async def commit(session: AsyncClientSession, bound: float | None) -> PyMongoError | None:
    """Commit, the wait for the majority bounded by ``bound`` (a wait that runs out is an unknown result):
    None once committed, the error when the result is unknown; one that did not apply raises :class:`Replay`."""
    try:
        with pymongo.timeout(bound):
            await session.commit_transaction()
        return None
    except PyMongoError as exc:
        if rules.classify_error(error_labels(exc), in_commit=True) is ErrorStep.REPLAY:
            discard_server_session(session, end_on_server=False)  # not committed (MongoDB aborted it): replay
            raise Replay(f"commit failed: {type(exc).__name__}") from exc
        return exc


async def retry_commit(session: AsyncClientSession, policy: Rules, deadline: Deadline = NO_DEADLINE) -> bool:
    """After an unknown result: the same commit again, at most ``policy.commit_retries`` times with backoff,
    each bounded by its share of ``deadline`` (the read that decides still to come); True once one applied.

    Whatever it returns, the session is not reused (its server session is discarded when none applied).
    """
    for retry in range(policy.commit_retries):
        delay = policy.backoff(retry)
        parts = policy.commit_retries - retry + 1  # this retry, the ones after it, the read
        if not deadline.allows(delay, parts):
            break  # no time left for another commit: the read decides before the deadline
        await asyncio.sleep(delay)
        try:
            with pymongo.timeout(deadline.bound(parts)):
                await session.commit_transaction()
            return True
        except PyMongoError as exc:
            if rules.classify_error(error_labels(exc), in_commit=True) is not ErrorStep.RETRY_COMMIT:
                break
    discard_server_session(session)
    return False


def majority_reads(collection: AsyncCollection[Any]) -> AsyncCollection[Any]:
    """``collection`` read with majority read concern from the primary, whatever the client's read
    preference: a secondary may not have applied what was just committed there."""
    return collection.with_options(read_concern=ReadConcern("majority"), read_preference=ReadPreference.PRIMARY)


async def read_back(majority: AsyncCollection[Any], key: object, bound: float | None) -> dict[str, Any] | None:
    """The transaction's own record (``_id`` ``key``) from a :func:`majority_reads` collection."""
    with pymongo.timeout(bound):
        record: dict[str, Any] | None = await majority.find_one({"_id": key})
    return record


async def read_backs(majority: AsyncCollection[Any], keys: list[Any], bound: float | None) -> dict[Any, dict[str, Any]]:
    """The records of a transaction that wrote many (``_id`` in ``keys``), by key, in one read from a
    :func:`majority_reads` collection (a batch handler's, docs/handlers.md)."""
    with pymongo.timeout(bound):
        found = await majority.find({"_id": {"$in": keys}}).to_list()
    return {record["_id"]: record for record in found}


async def abort_quietly(session: AsyncClientSession, bound: float | None) -> None:
    """Abort the session's transaction, if open; an abort that fails drops the server session instead.

    PyMongo ignores a failed ``abortTransaction`` (the transactions specification says to), but a
    network error marks its server session dirty: then the transaction may still be open on the
    server, and the session is discarded and ended there too (:func:`discard_server_session`).
    """
    if session.in_transaction:
        try:
            with pymongo.timeout(bound):
                await session.abort_transaction()
        except PyMongoError:
            discard_server_session(session)
            return
        if getattr(getattr(session, "_server_session", None), "dirty", False) is True:
            discard_server_session(session)
