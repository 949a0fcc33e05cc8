"""The rules of a MongoDB transaction, shared by the inbox and ``Outbox.transaction`` (docs/inbox.md): what an
error's labels mean (a label decides, never a code or a message), how many replays, how the record read back
after an unknown commit decides. Pure: the skeleton that performs them is :mod:`.transactions`."""

from __future__ import annotations

import enum
import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .._backoff import backoff

__all__ = [
    "NO_DEADLINE",
    "TRANSACTION_LABELS",
    "TRANSIENT_LABEL",
    "UNKNOWN_COMMIT_LABEL",
    "Deadline",
    "ErrorStep",
    "ReadBack",
    "Rules",
    "classify_error",
    "next_after_replay",
    "read_back_verdict",
]

# The labels MongoDB puts on transaction errors: what decides a replay or a commit retry.
TRANSIENT_LABEL = "TransientTransactionError"
UNKNOWN_COMMIT_LABEL = "UnknownTransactionCommitResult"
TRANSACTION_LABELS = (TRANSIENT_LABEL, UNKNOWN_COMMIT_LABEL)


class ErrorStep(enum.Enum):
    REPLAY = "replay"  # abort; replay the whole attempt in a fresh transaction (docs/inbox.md, step 5)
    RETRY_COMMIT = "retry_commit"  # the commit's result is unknown: retry the same commit (docs/inbox.md, step 6)
    DEFER = "defer"  # abort; the caller gives up on this transaction (an inbox delivery is requeued)


def classify_error(labels: Collection[str], *, in_commit: bool) -> ErrorStep:
    """What a database error inside a transaction means, by its labels (never by code or message).

    A commit that fails *without* ``UnknownTransactionCommitResult`` did not commit:
    it replays like a transient error.
    """
    if in_commit:
        return ErrorStep.RETRY_COMMIT if UNKNOWN_COMMIT_LABEL in labels else ErrorStep.REPLAY
    return ErrorStep.REPLAY if TRANSIENT_LABEL in labels else ErrorStep.DEFER


def next_after_replay(replays: int, budget: int) -> ErrorStep:
    """After the ``replays``-th replay request: replay again within the budget, else give up."""
    return ErrorStep.REPLAY if replays <= budget else ErrorStep.DEFER


class ReadBack(enum.Enum):
    COMMITTED = "committed"  # the transaction's own record is there: it committed
    OTHERS = "others"  # another transaction's completed record is there (an inbox duplicate)
    UNKNOWN = "unknown"  # nothing completed is visible: it may or may not have committed


def read_back_verdict(
    record: Mapping[str, Any] | None, *, completed: Mapping[str, object], ours: Mapping[str, object]
) -> ReadBack:
    """What the record read back after an unknown commit says: ``completed`` are the fields a committed
    record has, ``ours`` the ones only this transaction writes (its owner and token, say)."""
    if record is None or any(record.get(name) != value for name, value in completed.items()):
        return ReadBack.UNKNOWN
    if all(record.get(name) == value for name, value in ours.items()):
        return ReadBack.COMMITTED
    return ReadBack.OTHERS


@dataclass(frozen=True, slots=True, kw_only=True)
class Rules:
    """How often a transaction is replayed and its commit retried, and the jittered backoff between."""

    replay_budget: int
    commit_retries: int
    backoff_base: float
    backoff_max: float

    def backoff(self, n: int) -> float:
        return backoff(n, base=self.backoff_base, cap=self.backoff_max, jitter=random.random())


class Deadline(Protocol):
    """The time a transaction's waits share (an inbox delivery's deadline, say)."""

    def bound(self, parts: int) -> float | None:
        """The bound of one of ``parts`` waits still to come (None: unbounded)."""
        ...

    def allows(self, delay: float, parts: int) -> bool:
        """Is there time for a pause of ``delay`` seconds, then ``parts`` bounded waits?"""
        ...


class _NoDeadline:
    def bound(self, parts: int) -> float | None:
        return None

    def allows(self, delay: float, parts: int) -> bool:
        return True


NO_DEADLINE: Deadline = _NoDeadline()
