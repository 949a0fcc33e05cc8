"""A simulated MongoDB replica set with the async client surface :mod:`lily_mongo._inbox` uses.

The protocol model (``test_inbox_model.py``) runs the shipped ``Inbox`` against it. Every
operation the inbox sends is held at the server until the model lets it through, with or
without a fault, so a hypothesis run chooses the interleaving. What it keeps of MongoDB
(its documented transaction and replication behaviour):

* **Documents and optimes.** Every write gets the next optime; each document keeps its
  versions, so a read sees the state as of any optime.
* **Transactions.** A transaction's snapshot is taken at its first operation (snapshot read
  concern), it reads that snapshot plus its own writes, and it conflicts **per document, at
  the write**: writing a document another open transaction wrote, or that anyone committed
  a write to after the snapshot, fails with ``WriteConflict`` (code 112) labelled
  ``TransientTransactionError`` and aborts the transaction. Its commit applies all its
  writes at one optime.
* **Writers outside a transaction wait** while an open transaction has written their
  document, until it commits or aborts, or until their ``maxTimeMS`` runs out
  (``MaxTimeMSExpired``, code 50: PyMongo's ``ExecutionTimeout``). ``maxTimeMS`` is read
  from PyMongo's own operation timeout (``pymongo.timeout``), as the driver would send it.
* **Write concern and replication.** A primary and one secondary (with an arbiter: a
  primary-secondary-arbiter set, majority two of three). The secondary is up (it applies
  at once), lagging (it applies when told) or down. A ``w: 1`` write is acknowledged when
  applied; a ``w: "majority"`` write once the secondary has it, and a write that changes
  nothing waits for the primary's last optime (MongoDB sets a no-op write's optime to the
  system's last one). A majority wait that outlives ``maxTimeMS`` fails with a write
  concern error (code 50, PyMongo's ``WTimeoutError``); the write stays applied. Majority
  reads see the state as of the majority point. A commit (always ``w: "majority"`` in the
  inbox) waits the same way, and a read-only one waits for its snapshot.
* **Failover.** The primary dies; the secondary, with the arbiter, takes over with what it
  has: every write past the majority point is rolled back (``w: 1`` writes and commits
  whose reply was still waiting among them). Open transactions are aborted and every
  waiting operation fails with a network error.
* **Commit replies lost.** A commit can apply with its reply lost, or stay in flight with
  its reply lost (it may apply later, or the transaction is aborted);
  ``UnknownTransactionCommitResult`` either way. Retrying the commit of a committed
  transaction succeeds; of an aborted one, ``NoSuchTransaction`` (251, transient).
* **The transaction lifetime.** A reaper runs every half of ``transactionLifetimeLimitSeconds``
  and aborts transactions older than it (so a transaction lives up to about 1.5 times the
  limit); ``getParameter`` answers the limit.

The updates the inbox sends are recognised (the claim pipeline, the completion, ...) and
evaluated through their Python transitions in :mod:`lily_mongo._inbox.protocol`
(``tests/integration/test_record_pipelines.py`` holds each equal to the server's), called
through the module so the mutation run can replace them.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import datetime
import enum
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pymongo import _csot
from pymongo.errors import (
    AutoReconnect,
    ExecutionTimeout,
    NetworkTimeout,
    OperationFailure,
    PyMongoError,
    WTimeoutError,
)
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

import lily_mongo._inbox.first_claim as first_claim
import lily_mongo._inbox.protocol as records
from lily_mongo._inbox.protocol import COMPLETED, LEASED
from lily_mongo._mongo.rules import TRANSIENT_LABEL, UNKNOWN_COMMIT_LABEL

EPOCH = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)
Doc = dict[str, Any]

# Who sent an operation: the model sets it in each task (a delivery, a heartbeat).
ACTOR: contextvars.ContextVar[object | None] = contextvars.ContextVar("ACTOR", default=None)


class Fault(enum.Enum):
    """How the server answers one operation the model lets through."""

    def __repr__(self) -> str:
        return f"Fault.{self.name}"

    NONE = "none"
    TRANSIENT = "transient"  # in a transaction: WriteConflict, TransientTransactionError, the transaction aborted
    ERROR = "error"  # refused without a label, not applied (a transaction's operation: the transaction aborted)
    LOST = "lost"  # applied, the reply lost (a commit: UnknownTransactionCommitResult; else a network error)
    PENDING = "pending"  # a commit: its reply lost before it applied (it may apply later)


class TxnState(enum.Enum):
    OPEN = "open"
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass(eq=False)
class Txn:
    tid: int
    session: SimSession
    actor: object
    snapshot: int | None = None  # the optime of its first operation
    started: float | None = None  # the server clock at its first operation
    writes: dict[str, Doc | None] = field(default_factory=dict)
    state: TxnState = TxnState.OPEN
    aborted_by: str = ""  # "reaper", "failover", "server", "client", "conflict", "error", "killed"
    commit_optime: int | None = None
    in_flight: bool = False  # a commit was sent and its reply lost before it applied
    rolled_back: bool = False


@dataclass(eq=False)
class Op:
    oid: int
    kind: str  # find_one_and_update, update_one, delete_one, find_one, commit
    collection: str
    actor: object
    client: SimClient
    future: asyncio.Future[Any]
    filter: Doc = field(default_factory=dict)
    update: Any = None
    upsert: bool = False
    after: bool = False
    projection: Doc | None = None
    txn: Txn | None = None
    majority: bool = False  # the write concern (or read concern) is majority
    deadline: float | None = None  # maxTimeMS, on the server clock
    awaiting: int | None = None  # applied; waiting for the majority point to reach this optime
    reply: Any = None  # what it answers once the majority point is reached
    orphan: bool = False  # its sender stopped waiting (cancelled, or its process died)

    @property
    def key(self) -> str:
        return str(self.filter.get("_id", ""))

    @property
    def writes(self) -> bool:
        return self.kind in ("find_one_and_update", "update_one", "delete_one")

    def describe(self) -> str:
        what = self.kind if self.kind != "commit" else f"commit txn {self.txn.tid if self.txn else '-'}"
        name = update_name(self.update) if self.update is not None else ""
        where = f" {self.key}" if self.key else ""
        txn = f" in txn {self.txn.tid}" if self.txn and self.kind != "commit" else ""
        return f"{what}{f'({name})' if name else ''}{where}{txn}"


def failure(message: str, code: int, labels: tuple[str, ...] = ()) -> OperationFailure:
    details = {"ok": 0, "errmsg": message, "code": code, "errorLabels": list(labels)}
    return OperationFailure(message, code, details)


def network(message: str, labels: tuple[str, ...] = ()) -> AutoReconnect:
    exc = AutoReconnect(message)
    for label in labels:
        exc._add_error_label(label)
    return exc


def no_such_transaction() -> OperationFailure:
    return failure("NoSuchTransaction: the transaction was aborted", 251, (TRANSIENT_LABEL,))


def write_conflict(key: str) -> OperationFailure:
    return failure(f"WriteConflict on {key}", 112, (TRANSIENT_LABEL,))


# -- the updates the inbox sends, recognised and evaluated through records' transitions -------------


def update_name(update: Any) -> str:
    """Which of the inbox's updates this is (the handler's ``$push`` included)."""
    if isinstance(update, dict):
        if "$setOnInsert" in update:
            return "first-claim"
        if "$push" in update:
            return "handler-write"
        raise AssertionError(f"an update the model does not know: {update!r}")
    assert isinstance(update, list), update
    first = update[0].get("$set", {})
    if "_lily_free" in first:
        return "claim"
    if first.get("state") == COMPLETED:
        return "completion"
    if set(first) == {"expires_at", "purge_at"}:
        return "renewal"
    if set(first) == {"owner", "expires_at", "deferrals"}:
        return "deferral-release"
    if set(first) == {"owner", "expires_at"}:
        return "release"
    if records.DEFERRALS in first or records.EXPIRATIONS in first:
        return "count"
    raise AssertionError(f"an update the model does not know: {update!r}")


def _seconds(ms: object) -> float:
    assert isinstance(ms, int), ms
    return ms / 1000


def evaluate(update: Any, record: Doc | None, flt: Doc, key: str, now: datetime.datetime, tid: int) -> Doc | None:
    """The record after ``update`` with filter ``flt``; None when the filter matches nothing."""
    name = update_name(update)
    if name == "first-claim":
        fields = update["$setOnInsert"]
        return first_claim.first_claim_transition(
            record,
            key=key,
            handler_id=fields["handler"],
            event_id=fields["event_id"],
            owner=fields["owner"],
            now=now,
            retention_seconds=(fields["purge_at"] - fields["completed_at"]).total_seconds(),
        )
    if name == "handler-write":
        doc: Doc = copy.deepcopy(record) if record is not None else {"_id": key}
        for name_, value in update["$push"].items():
            doc[name_] = [*doc.get(name_, []), [*value, tid]]
        return doc
    if name == "claim":
        fields = update[1]["$set"]
        owner = fields["owner"]["$cond"][1]
        lease = _seconds(fields["expires_at"]["$cond"][1]["$add"][1])
        stale = _seconds(fields["purge_at"]["$cond"][1]["$add"][1]) - lease
        handler_id, event_id = fields["handler"], fields["event_id"]
        expected = records.claim_pipeline(handler_id, event_id, owner, lease_seconds=lease, stale_seconds=stale)
        assert update == expected, "the claim is not records.claim_pipeline"
        return records.claim_transition(
            record,
            key=key,
            handler_id=handler_id,
            event_id=event_id,
            owner=owner,
            now=now,
            lease_seconds=lease,
            stale_seconds=stale,
        )
    if name == "count":
        fields = update[0]["$set"]
        counter = records.DEFERRALS if records.DEFERRALS in fields else records.EXPIRATIONS
        stale = _seconds(fields["purge_at"]["$max"][1]["$add"][1])
        handler_id, event_id = fields["handler"]["$ifNull"][1], fields["event_id"]["$ifNull"][1]
        assert update == records.count_update(counter, handler_id, event_id, stale_seconds=stale)
        return records.count_transition(
            record, counter, key=key, handler_id=handler_id, event_id=event_id, now=now, stale_seconds=stale
        )
    owner, token = flt["owner"], flt["token"]
    assert flt == records.fence(key, owner, token), f"a {name} not fenced by records.fence: {flt}"
    if name == "completion":
        retention = _seconds(update[0]["$set"]["purge_at"]["$add"][1])
        return records.completion_transition(record, owner, token, now=now, retention_seconds=retention)
    if name == "renewal":
        fields = update[0]["$set"]
        lease = _seconds(fields["expires_at"]["$add"][1])
        stale = _seconds(fields["purge_at"]["$add"][1]) - lease
        return records.renewal_transition(record, owner, token, now=now, lease_seconds=lease, stale_seconds=stale)
    if name == "deferral-release":
        after, matched = records.release_transition(record, owner, token, now=now, deferred=True)
        return after if matched else None
    assert name == "release"
    return records.released_transition(record, owner, token, now=now)


def matches(doc: Doc | None, flt: Doc) -> bool:
    """A filter of equalities and ``$in`` lists (None in ``$in`` matches a missing field)."""
    if doc is None:
        return False
    for name, wanted in flt.items():
        value = doc.get(name)
        if isinstance(wanted, dict):
            assert set(wanted) == {"$in"}, wanted
            if value not in wanted["$in"]:
                return False
        elif value != wanted:
            return False
    return True


def project(doc: Doc | None, projection: Doc | None) -> Doc | None:
    if doc is None or projection is None:
        return copy.deepcopy(doc)
    return {name: copy.deepcopy(value) for name, value in doc.items() if name == "_id" or projection.get(name)}


# -- the server ------------------------------------------------------------------------------------


class Server:
    """The replica set: documents with their versions, transactions, waiting operations."""

    def __init__(self, clock: Callable[[], float], *, lifetime: float, answers_lifetime: bool = True) -> None:
        self.clock = clock
        self.lifetime = lifetime
        self.answers_lifetime = answers_lifetime
        self.chains: dict[str, list[tuple[int, Doc | None]]] = {}
        self.optime = 0
        self.majority = 0
        self.secondary = "up"  # "up" (applies at once), "lagging" (applies when told), "down"
        self.failovers = 0
        self.txns: list[Txn] = []
        self.ops: list[Op] = []  # sent and not yet answered (waiting ones among them)
        self._ids = itertools.count(1)
        self.trace: Callable[[str], None] = lambda line: None
        # Hooks the model sets to watch the server: (op, key, before, after) for every applied
        # write outside a transaction; (txn) for every commit that applied; (rolled-back
        # entries) for a failover's rollback.
        self.on_write: Callable[[Op, str, Doc | None, Doc | None], None] = lambda op, key, before, after: None
        self.on_commit: Callable[[Txn], None] = lambda txn: None
        self.on_rollback: Callable[[list[tuple[str, int, Doc | None, Doc | None]]], None] = lambda lost: None
        self.on_answer: Callable[[Op, BaseException | None], None] = lambda op, error: None

    @property
    def now(self) -> datetime.datetime:
        return EPOCH + datetime.timedelta(seconds=self.clock())

    # -- documents -------------------------------------------------------------------------------

    def doc(self, key: str, at: int | None = None) -> Doc | None:
        """The document as of optime ``at`` (the primary's latest when None)."""
        chain = self.chains.get(key, [])
        found: Doc | None = None
        for optime, doc in chain:
            if at is not None and optime > at:
                break
            found = doc
        return copy.deepcopy(found)

    def majority_doc(self, key: str) -> Doc | None:
        return self.doc(key, self.majority)

    def version(self, key: str) -> int:
        chain = self.chains.get(key)
        return chain[-1][0] if chain else 0

    def keys(self) -> list[str]:
        return sorted(self.chains)

    def docs(self, at: int | None = None) -> Iterator[tuple[str, Doc]]:
        for key in self.keys():
            doc = self.doc(key, at)
            if doc is not None:
                yield key, doc

    def _write(self, writes: dict[str, Doc | None]) -> int:
        self.optime += 1
        for key, doc in writes.items():
            self.chains.setdefault(key, []).append((self.optime, copy.deepcopy(doc)))
        if self.secondary == "up":
            self.majority = self.optime
        return self.optime

    def holder(self, key: str) -> Txn | None:
        """The open transaction that has written ``key``: writers outside it wait, others conflict."""
        return next((t for t in self.txns if t.state is TxnState.OPEN and key in t.writes), None)

    def open_txns(self) -> list[Txn]:
        """The transactions the server holds open: started by a first operation that reached it (a
        transaction whose first command never arrived does not exist on the server)."""
        return [t for t in self.txns if t.state is TxnState.OPEN and t.started is not None]

    # -- operations ------------------------------------------------------------------------------

    def submit(self, op: Op) -> None:
        self.ops.append(op)

    def blocked(self, op: Op) -> bool:
        """A write outside a transaction to a document an open transaction holds waits for it."""
        return op.awaiting is None and op.txn is None and op.writes and self.holder(op.key) is not None

    def ready(self, op: Op) -> bool:
        """Can the model let ``op`` through now (it is neither waiting behind a transaction nor for the majority)?"""
        return op.awaiting is None and not self.blocked(op)

    def _answer(self, op: Op, value: Any = None, error: BaseException | None = None) -> None:
        if op in self.ops:
            self.ops.remove(op)
        if op.future.done():
            return
        self.on_answer(op, error)
        if error is not None:
            op.future.set_exception(error)
        else:
            op.future.set_result(value)

    def _acknowledge(self, op: Op, value: Any, target: int) -> None:
        """Answer a majority write (or a commit) once the majority point reaches ``target``."""
        if not op.majority or self.majority >= target:
            self._answer(op, value)
            return
        op.awaiting, op.reply = target, value

    def resolve(self, op: Op, fault: Fault = Fault.NONE) -> str:
        """Let ``op`` through with ``fault``; returns what happened, for the trace."""
        if op.awaiting is not None:
            # Its write applied; only the acknowledgement waits. A fault here loses the reply
            # (a wtimeout, a dropped connection): for a commit, UnknownTransactionCommitResult.
            if fault is Fault.NONE:
                return "still waiting for the majority"
            if op.kind == "commit":
                self._answer(op, error=network("the commit's reply was lost", (UNKNOWN_COMMIT_LABEL,)))
            else:
                self._answer(op, error=network("the write's reply was lost"))
            return "applied; the reply waiting for the majority was lost"
        assert not self.blocked(op), f"{op.describe()} is waiting behind a transaction"
        if op.kind == "commit":
            return self._commit(op, fault)
        if op.kind == "find_one":
            at = self.majority if op.majority else None
            self._answer(
                op, project(self.doc(op.key, at) if op.txn is None else self._view(op.txn, op.key), op.projection)
            )
            return "read"
        if op.txn is not None:
            return self._in_transaction(op, fault)
        if fault is Fault.ERROR:
            self._answer(op, error=failure("the server refused the write", 2))
            return "refused, not applied"
        before = self.doc(op.key)
        after = self._apply_outside(op, before)
        changed = after != before
        target = self._write({op.key: after}) if changed else self.optime
        self.on_write(op, op.key, before, after)
        value = self._result(op, before, after)
        if fault is Fault.LOST:
            self._answer(op, error=network("the write's reply was lost"))
            return f"applied ({'changed' if changed else 'no change'}), reply lost"
        self._acknowledge(op, value, target)
        return f"applied ({'changed' if changed else 'no change'})" + (
            ", waits for the majority" if op.awaiting else ""
        )

    def _apply_outside(self, op: Op, before: Doc | None) -> Doc | None:
        if op.kind == "delete_one":
            return None if matches(before, op.filter) else before
        after = evaluate(op.update, before, op.filter, op.key, self.now, 0)
        if after is None:  # the filter matched nothing
            return before
        if before is None and not op.upsert:
            return None
        return after

    def _result(self, op: Op, before: Doc | None, after: Doc | None) -> Any:
        if op.kind == "find_one_and_update":
            if before is None and after is None:
                return None
            matched = before is not None and (after != before or matches(before, op.filter))
            if not matched and not (before is None and after is not None):
                return None
            return project(after if op.after else before, op.projection)
        if op.kind == "update_one":
            return UpdateResult(
                matched_count=int(before is not None and (after != before or matches(before, op.filter)))
            )
        return DeleteResult(deleted_count=int(before is not None and after is None))

    def _view(self, txn: Txn, key: str) -> Doc | None:
        if key in txn.writes:
            return copy.deepcopy(txn.writes[key])
        return self.doc(key, txn.snapshot)

    def _in_transaction(self, op: Op, fault: Fault) -> str:
        txn = op.txn
        assert txn is not None
        if txn.state is not TxnState.OPEN:
            self._answer(op, error=no_such_transaction())
            return "NoSuchTransaction"
        if txn.snapshot is None:
            txn.snapshot, txn.started = self.optime, self.clock()
        if fault in (Fault.TRANSIENT, Fault.ERROR):
            self._abort(txn, "conflict" if fault is Fault.TRANSIENT else "error")
            error = write_conflict(op.key) if fault is Fault.TRANSIENT else failure("the server refused it", 2)
            self._answer(op, error=error)
            return f"failed ({fault.value}); txn {txn.tid} aborted"
        before = self._view(txn, op.key)
        after = evaluate(op.update, before, op.filter, op.key, self.now, txn.tid)
        if after is None or (before is None and not op.upsert) or after == before:
            self._answer(op, self._result(op, before, before))
            return "no change"
        other = self.holder(op.key)
        if (other is not None and other is not txn) or self.version(op.key) > txn.snapshot:
            self._abort(txn, "conflict")
            self._answer(op, error=write_conflict(op.key))
            return f"WriteConflict; txn {txn.tid} aborted"
        txn.writes[op.key] = after
        self.on_write(op, op.key, before, after)
        self._answer(op, self._result(op, before, after))
        return "written in the transaction"

    def _commit(self, op: Op, fault: Fault) -> str:
        txn = op.txn
        if txn is None:
            self._answer(op, None)
            return "nothing to commit"
        if txn.rolled_back:  # the new primary never heard of it
            self._answer(op, error=no_such_transaction())
            return "NoSuchTransaction (rolled back by the failover)"
        if txn.state is TxnState.COMMITTED:  # a retried commit of an applied transaction
            if fault in (Fault.LOST, Fault.PENDING):
                self._answer(op, error=network("the commit's reply was lost again", (UNKNOWN_COMMIT_LABEL,)))
                return "already applied; the reply lost again"
            assert txn.commit_optime is not None
            self._acknowledge(op, None, txn.commit_optime)
            return "already applied: ok"
        if txn.state is TxnState.ABORTED:
            self._answer(op, error=no_such_transaction())
            return f"NoSuchTransaction (aborted by {txn.aborted_by})"
        if fault is Fault.TRANSIENT:
            self._abort(txn, "conflict")
            self._answer(op, error=failure("the commit failed, not applied", 112, (TRANSIENT_LABEL,)))
            return "failed, not applied (transient)"
        if fault is Fault.ERROR:
            self._abort(txn, "error")
            self._answer(op, error=failure("the commit failed, not applied", 2))
            return "failed, not applied (no label)"
        if fault is Fault.PENDING:
            txn.in_flight = True
            self._answer(op, error=network("the commit's reply was lost", (UNKNOWN_COMMIT_LABEL,)))
            return "in flight, reply lost"
        self.apply_commit(txn)
        assert txn.commit_optime is not None
        if fault is Fault.LOST:
            self._answer(op, error=network("the commit's reply was lost", (UNKNOWN_COMMIT_LABEL,)))
            return "applied, reply lost"
        self._acknowledge(op, None, txn.commit_optime)
        return "committed" + (", waits for the majority" if op.awaiting else "")

    def apply_commit(self, txn: Txn) -> None:
        assert txn.state is TxnState.OPEN
        txn.state, txn.in_flight = TxnState.COMMITTED, False
        # A read-only transaction writes nothing; its majority commit waits for its snapshot.
        txn.commit_optime = self._write(dict(txn.writes)) if txn.writes else (txn.snapshot or 0)
        self.on_commit(txn)

    def begin(self, session: SimSession) -> Txn:
        txn = Txn(tid=len(self.txns) + 1, session=session, actor=ACTOR.get())
        self.txns.append(txn)
        return txn

    def _abort(self, txn: Txn, by: str) -> None:
        if txn.state is TxnState.OPEN:
            txn.state, txn.aborted_by, txn.in_flight = TxnState.ABORTED, by, False

    def abort(self, txn: Txn, by: str) -> None:
        """The server aborts ``txn`` (a stepdown, the reaper): its waiting commit learns it too."""
        self._abort(txn, by)
        for op in [o for o in self.ops if o.kind == "commit" and o.txn is txn and o.awaiting is None]:
            self._answer(op, error=no_such_transaction())

    # -- time, replication, failover ---------------------------------------------------------------

    def reap(self) -> list[Txn]:
        """The reaper's pass: abort every transaction older than the lifetime."""
        now = self.clock()
        old = [t for t in self.open_txns() if t.started is not None and now - t.started >= self.lifetime]
        for txn in old:
            self.abort(txn, "reaper")
            self.trace(f"the reaper aborts txn {txn.tid} (started t={txn.started:g})")
        return old

    def expire(self) -> None:
        """Operations whose ``maxTimeMS`` ran out: a wait behind a transaction, or for the majority."""
        now = self.clock()
        for op in [o for o in self.ops if o.deadline is not None and o.deadline <= now]:
            if op.awaiting is not None:
                error: PyMongoError = WTimeoutError(
                    "waiting for replication timed out (maxTimeMS)", 50, {"code": 50, "codeName": "MaxTimeMSExpired"}
                )
                self.trace(f"{op.describe()}: its majority wait ran out of maxTimeMS")
            elif self.blocked(op):
                error = ExecutionTimeout("operation exceeded time limit", 50, {"code": 50})
                self.trace(f"{op.describe()}: its wait behind a transaction ran out of maxTimeMS")
            else:  # not yet taken up (a slow server): the client's own timeout; the server drops it
                error = NetworkTimeout("timed out (the operation timeout)")
                self.trace(f"{op.describe()}: no answer within its operation timeout")
            if op.kind == "commit":  # PyMongo labels a commit's timeout an unknown result
                error._add_error_label(UNKNOWN_COMMIT_LABEL)
            self._answer(op, error=error)

    def replicate(self) -> None:
        """The secondary catches up; every acknowledgement waiting for the majority is answered."""
        if self.secondary != "down":
            self.majority = self.optime
        self.release_waiters()

    def release_waiters(self) -> None:
        for op in [o for o in self.ops if o.awaiting is not None and o.awaiting <= self.majority]:
            self._answer(op, op.reply)

    def set_secondary(self, state: str) -> None:
        self.secondary = state
        if state == "up":
            self.replicate()

    def failover(self) -> list[tuple[str, int, Doc | None, Doc | None]]:
        """The primary dies; the secondary takes over with what it has; later writes are rolled back."""
        cut = self.majority
        lost: list[tuple[str, int, Doc | None, Doc | None]] = []
        for key, chain in self.chains.items():
            kept = [(optime, doc) for optime, doc in chain if optime <= cut]
            for optime, doc in chain[len(kept) :]:
                lost.append((key, optime, kept[-1][1] if kept else None, doc))
            self.chains[key] = kept
        self.optime = cut
        for txn in self.txns:
            if txn.state is TxnState.COMMITTED and txn.commit_optime is not None and txn.commit_optime > cut:
                txn.rolled_back = True
            self._abort(txn, "failover")
        for op in list(self.ops):
            labels = (UNKNOWN_COMMIT_LABEL,) if op.kind == "commit" else (TRANSIENT_LABEL,) if op.txn else ()
            self._answer(op, error=network("the primary stepped down", labels))
        self.failovers += 1
        self.secondary = "up"
        self.on_rollback(lost)
        return lost


@dataclass(frozen=True)
class UpdateResult:
    matched_count: int


@dataclass(frozen=True)
class DeleteResult:
    deleted_count: int


# -- the client surface -----------------------------------------------------------------------------


def _timeout() -> float | None:
    """The operation timeout PyMongo would send as maxTimeMS (``pymongo.timeout``), in seconds."""
    remaining = _csot.remaining()
    return None if remaining is None else max(round(remaining, 3), 0.0)


class SimClient:
    """One consumer process's client: ``w`` is its default write concern (its URI's)."""

    def __init__(self, server: Server, *, w: str) -> None:
        self.server = server
        self.w = w
        self.dead = False
        self.admin = SimAdmin(self)
        self.sessions: dict[int, SimSession] = {}  # by lsid: what killSessions names

    def __getitem__(self, name: str) -> SimDatabase:
        return SimDatabase(self, name)

    def start_session(self, causal_consistency: bool = False) -> SimSession:
        return SimSession(self)

    def check(self) -> None:
        if self.dead:
            raise network("the process is gone")

    async def send(self, op_fields: dict[str, Any]) -> Any:
        """Send one operation and wait for the server's answer (the model lets it through)."""
        self.check()
        server = self.server
        loop = asyncio.get_running_loop()
        timeout = _timeout()
        op = Op(
            oid=next(server._ids),
            actor=ACTOR.get(),
            client=self,
            future=loop.create_future(),
            deadline=None if timeout is None else server.clock() + timeout,
            **op_fields,
        )
        server.submit(op)
        try:
            return await op.future
        finally:
            if not op.future.done() or op.future.cancelled():
                op.orphan = True  # the server may still apply it


class SimAdmin:
    def __init__(self, client: SimClient) -> None:
        self.client = client

    async def command(self, command: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.client.check()
        server = self.client.server
        name = command if isinstance(command, str) else next(iter(command))
        if name == "hello":
            return {"ok": 1, "localTime": server.now}
        if name == "getParameter":
            if not server.answers_lifetime:
                raise failure("not authorized on admin to execute command getParameter", 13)
            return {"ok": 1, "transactionLifetimeLimitSeconds": server.lifetime}
        if name == "killSessions":  # MongoDB aborts each named session's transaction unless it committed
            for spec in command[name]:
                session = self.client.sessions.get(spec["id"])
                if session is not None and session._txn is not None:
                    server.abort(session._txn, "killed")
            return {"ok": 1}
        raise AssertionError(f"the model does not know the command {name}")


@dataclass(eq=False)
class SimDatabase:
    """A database handle: its collections are on ``client``."""

    client: SimClient
    name: str

    def __getitem__(self, name: str) -> SimCollection:
        return SimCollection(self.client, name)


class SimCollection:
    """A collection handle; ``write_concern``/``read_concern`` None: the client's defaults."""

    def __init__(
        self,
        client: SimClient,
        name: str,
        write_concern: WriteConcern | None = None,
        read_concern: ReadConcern | None = None,
    ) -> None:
        self.client = client
        self.name = name
        self.write_concern = write_concern
        self.read_concern = read_concern

    def with_options(
        self, *, write_concern: WriteConcern | None = None, read_concern: ReadConcern | None = None, **_: Any
    ) -> SimCollection:
        return SimCollection(
            self.client, self.name, write_concern or self.write_concern, read_concern or self.read_concern
        )

    def _majority_write(self) -> bool:
        if self.write_concern is not None:
            return self.write_concern.document.get("w") == "majority"
        return self.client.w == "majority"

    def _txn(self, session: SimSession | None) -> Txn | None:
        if session is None or not session.in_transaction:
            return None
        return session.server_txn()

    async def create_index(self, keys: Any, **options: Any) -> str:
        self.client.check()
        return str(options.get("name", "index"))

    async def index_information(self) -> dict[str, Any]:
        return {"lily_purge_at_ttl": {}}

    async def find_one_and_update(
        self,
        filter: Doc,
        update: Any,
        projection: Doc | None = None,
        *,
        upsert: bool = False,
        return_document: bool = False,
        session: SimSession | None = None,
        **_: Any,
    ) -> Doc | None:
        fields = {"kind": "find_one_and_update", "filter": dict(filter), "update": update, "upsert": upsert}
        fields |= {"after": bool(return_document), "projection": projection, "txn": self._txn(session)}
        found: Doc | None = await self.client.send(
            {**fields, "collection": self.name, "majority": self._majority_write()}
        )
        return found

    async def update_one(
        self, filter: Doc, update: Any, upsert: bool = False, *, session: SimSession | None = None, **_: Any
    ) -> UpdateResult:
        fields = {"kind": "update_one", "filter": dict(filter), "update": update, "upsert": upsert}
        fields |= {"txn": self._txn(session), "collection": self.name, "majority": self._majority_write()}
        result: UpdateResult = await self.client.send(fields)
        return result

    async def delete_one(self, filter: Doc, *, session: SimSession | None = None, **_: Any) -> DeleteResult:
        fields = {"kind": "delete_one", "filter": dict(filter), "txn": self._txn(session), "collection": self.name}
        result: DeleteResult = await self.client.send({**fields, "majority": self._majority_write()})
        return result

    async def find_one(
        self, filter: Doc, projection: Doc | None = None, *, session: SimSession | None = None, **_: Any
    ) -> Doc | None:
        majority = self.read_concern is not None and self.read_concern.level == "majority"
        fields = {"kind": "find_one", "filter": dict(filter), "projection": projection, "txn": self._txn(session)}
        found: Doc | None = await self.client.send({**fields, "collection": self.name, "majority": majority})
        return found


class _ServerSession:
    def __init__(self) -> None:
        self.dirty = False

    def mark_dirty(self) -> None:
        self.dirty = True


class SimSession:
    """A client session: its transaction is created on the server at its first operation."""

    def __init__(self, client: SimClient) -> None:
        self.client = client
        self.session_id = {"id": len(client.sessions)}
        client.sessions[self.session_id["id"]] = self
        self._server_session = _ServerSession()
        self._txn: Txn | None = None
        self._in_transaction = False
        self._started = False

    @property
    def in_transaction(self) -> bool:
        return self._in_transaction

    def server_txn(self) -> Txn:
        if self._txn is None:
            self._txn = self.client.server.begin(self)
        return self._txn

    async def start_transaction(self, **_: Any) -> None:
        self.client.check()
        assert not self._in_transaction, "a transaction is already in progress"
        self._txn, self._in_transaction, self._started = None, True, True

    async def commit_transaction(self) -> None:
        assert self._started, "no transaction started"
        self._in_transaction = False
        if self._txn is None or self._txn.snapshot is None:
            if self._txn is not None:  # created, no operation reached the server: nothing to commit
                self.client.server._abort(self._txn, "client")
            return
        await self.client.send({"kind": "commit", "collection": "", "txn": self._txn, "majority": True})

    async def abort_transaction(self) -> None:
        self._in_transaction = False
        self.client.check()
        if self._txn is not None:
            self.client.server._abort(self._txn, "client")

    async def end_session(self) -> None:
        if self._in_transaction and self._txn is not None and not self.client.dead:
            self.client.server._abort(self._txn, "client")
        self._in_transaction = False


def in_transaction_labels(exc: BaseException) -> tuple[str, ...]:
    """The transaction labels an exception carries (for the trace)."""
    if not isinstance(exc, PyMongoError):
        return ()
    return tuple(label for label in (TRANSIENT_LABEL, UNKNOWN_COMMIT_LABEL) if exc.has_error_label(label))


__all__ = [
    "ACTOR",
    "COMPLETED",
    "EPOCH",
    "LEASED",
    "Fault",
    "Op",
    "Server",
    "SimClient",
    "Txn",
    "TxnState",
    "evaluate",
    "update_name",
]
