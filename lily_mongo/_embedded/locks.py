"""Document locks: which open transaction holds which document, and the writers waiting for one.

A transaction takes a document's lock with its first write to it and keeps it until
it commits or aborts, as MongoDB's storage engine does. What happens to the next
writer is MongoDB's rule too (docs/emulator.md):

* a write **inside another transaction** never waits: it fails at once with
  WriteConflict (the engine's decision, :mod:`.engine`);
* a write **outside any transaction** waits here until the lock is released, for at
  most its command's ``maxTimeMS`` (:meth:`DocumentLocks.wait`), and then runs again
  on the document as it is then.

Why this cannot deadlock: only writers outside transactions wait, each for one lock,
holding none while it waits (a write outside a transaction takes no lock at all), and a
transaction never waits for anything. So every edge of the waits-for graph goes from a
write outside a transaction to a transaction, no edge leaves a transaction, and the
graph has no cycle. Each wait ends when the holder commits or aborts, when its
``maxTimeMS`` runs out, or when the server reaps the holder for its age
(``transactionLifetimeLimitSeconds``, :mod:`.engine`).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

__all__ = ["DocumentLock", "DocumentLocks", "LockKey", "command_deadline"]

LockKey = tuple[str, str, Hashable]  # database, collection, the document's storage key

# When the command being served runs out of its maxTimeMS (time.monotonic()), None without one:
# set by the wire layer for each command, read by a writer that waits.
command_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("command_deadline", default=None)


@dataclass(slots=True, eq=False)
class DocumentLock:
    """One document held by the transaction of session ``owner``."""

    key: LockKey
    owner: str
    released: bool = False
    _waiters: asyncio.Event | None = field(default=None, repr=False)  # made by the first waiter

    def release(self) -> None:
        self.released = True
        if self._waiters is not None:
            self._waiters.set()

    def _event(self) -> asyncio.Event:
        if self._waiters is None:
            self._waiters = asyncio.Event()
        return self._waiters


class DocumentLocks:
    """The lock table of one engine (the server is one event loop: no thread touches it)."""

    def __init__(self) -> None:
        self._held: dict[LockKey, DocumentLock] = {}
        self._by_owner: dict[str, list[DocumentLock]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def holder(self, key: LockKey) -> DocumentLock | None:
        """The lock on ``key``, if a transaction holds it."""
        return self._held.get(key)

    def take(self, key: LockKey, owner: str) -> DocumentLock:
        """``owner`` holds ``key`` from now on (it already does: the same lock); another holder is a bug."""
        lock = self._held.get(key)
        if lock is not None:
            if lock.owner != owner:
                raise RuntimeError(f"document {key!r} is held by another transaction")
            return lock
        lock = DocumentLock(key, owner)
        self._held[key] = lock
        self._by_owner.setdefault(owner, []).append(lock)
        return lock

    def nudge(self, owner: str) -> None:
        """Wake the writers waiting for ``owner``'s documents without releasing them: each looks again
        (whether the holder now yields them, :meth:`.transactions.TransactionBook.take_over`)."""
        for lock in self._by_owner.get(owner, ()):
            if lock._waiters is not None:
                lock._waiters.set()
                lock._waiters = None

    def release_all(self, owner: str) -> int:
        """Release every lock ``owner`` holds and wake their waiters; how many there were."""
        locks = self._by_owner.pop(owner, [])
        for lock in locks:
            del self._held[lock.key]
            lock.release()
        return len(locks)

    @staticmethod
    async def wait(lock: DocumentLock, deadline: float | None) -> bool:
        """Wait until ``lock`` is released or nudged (True: look again) or ``deadline``
        (``time.monotonic()``) passes (False)."""
        if lock.released:
            return True
        event = lock._event()
        if deadline is None:
            await event.wait()
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            async with asyncio.timeout(remaining):
                await event.wait()
        except TimeoutError:
            return lock.released or event.is_set()
        return True
