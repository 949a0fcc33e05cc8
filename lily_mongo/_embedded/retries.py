"""Retryable writes answered once: a driver's retry of a write gets the first attempt's reply.

A replica set member tells drivers it supports retryable writes, so PyMongo sends
each write outside a transaction with its session and a transaction number, and
sends it again after a network error. MongoDB recognises the retry by that pair and
answers it with the first attempt's reply instead of applying the write twice. The
embedded server answers as a replica set member (:mod:`.handshake`), so it does the
same: it keeps, per session, the latest write's transaction number and its reply.
A retry that arrives while the first attempt still runs waits for it. An attempt
that failed leaves nothing behind: its retry runs anew.
"""

from __future__ import annotations

import asyncio
import collections
import copy
from collections.abc import Awaitable, Callable
from typing import Any, Final

from mongoeco.wire._session_identity import wire_session_key

__all__ = ["RetryableWrites"]

_WRITES: Final = frozenset({"insert", "update", "delete", "findAndModify", "findandmodify"})
_KEPT: Final = 10_000  # sessions whose latest write is remembered (drivers reuse a few pooled sessions)

Reply = dict[str, Any]
_NOT_APPLIED: Final[Reply] = {}


class RetryableWrites:
    """The latest retryable write of each session and its reply."""

    def __init__(self) -> None:
        self._latest: collections.OrderedDict[str, tuple[object, asyncio.Future[Reply]]] = collections.OrderedDict()

    @staticmethod
    def key(context: Any) -> tuple[str, object] | None:
        """The (session, transaction number) of a retryable write outside a transaction, else None."""
        body = context.raw_body
        if context.command_name not in _WRITES or "autocommit" in body or "txnNumber" not in body:
            return None
        lsid = body.get("lsid")
        return None if lsid is None else (wire_session_key(lsid), body["txnNumber"])

    async def run(self, key: tuple[str, object], attempt: Callable[[], Awaitable[Reply]]) -> Reply:
        session, number = key
        latest = self._latest.get(session)
        if latest is not None and latest[0] == number:
            reply = await asyncio.shield(latest[1])
            if reply is not _NOT_APPLIED:
                return copy.deepcopy(reply)
        done: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._latest[session] = (number, done)
        self._latest.move_to_end(session)
        while len(self._latest) > _KEPT:
            self._latest.popitem(last=False)
        try:
            reply = await attempt()
        except BaseException:
            done.set_result(_NOT_APPLIED)
            raise
        done.set_result(reply)
        return reply
