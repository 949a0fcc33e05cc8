"""A protocol model of the inbox lease (docs/inbox.md) as a hypothesis state machine.

Several simulated consumers handle several copies of one or two events against a small
in-memory MongoDB. Every decision a consumer takes is the one :mod:`lily_mongo.records`
takes (``claim_transition`` and the other server-side transitions run as the updates the
model applies; ``read_claim``, ``classify_error``, ``next_after_replay``, ``reconcile``,
``may_renew`` and ``heartbeat_verdict`` decide what the consumer does next), and the
settlement of its verdict is :func:`lily_mongo.settlement.decide`. A copy delivered for the
first time claims inside its transaction when the run's ``claim_in_transaction`` says so
(``claims_in_transaction``, ``first_claim_transition``, ``read_first_claim``): half the
random runs take that path, the other half (and the lease scenarios) the lease claim first.

The simulated MongoDB keeps what the protocol relies on (docs/inbox.md, and MongoDB's
documented transaction behaviour):

* committed documents with a per-document commit version; a transaction reads the
  committed state as of its first operation (snapshot read concern) plus its own writes;
* write conflicts *at the write*: a transaction's write to a document that someone committed
  a write to after its snapshot, or that another open transaction has written, fails with
  ``WriteConflict`` labelled ``TransientTransactionError`` (and the server aborts it);
* a non-transactional write (claim, renewal, release) to a document an open transaction has
  written waits: the step is not enabled until that transaction commits or aborts;
* commit applies a transaction's writes atomically; a commit may fail without applying
  (``TransientTransactionError``), apply with its reply lost (``UnknownTransactionCommitResult``),
  or stay in flight with its reply lost (it applies later, or the server aborts it);
  a retried commit of an applied transaction succeeds;
* the server may abort any open transaction (lifetime limit, failover, crashed client);
* lease expiry on a server clock that a rule advances.

Around it: a FIFO broker (requeue, redelivery after a crash or a lost channel, retry and
DLQ copies), consumer crashes at any step, renewals between any two steps, duplicate and
concurrent deliveries.

Invariants (each failure names one, in brackets):

* ``at-most-once`` -- an event's business writes are committed at most once, all by the one
  transaction that committed its completion, and all of them or none;
* ``fencing`` -- a completion, renewal or release by an owner that is not the record's current
  (owner, token) never changes the committed record;
* ``exclusive-lease`` -- a claim never takes a live (unexpired) lease from its owner and never
  changes a completed record;
* ``claim-reading`` -- ``read_claim`` says LEASED only when the record is leased to this
  attempt, DUPLICATE only when it is completed, HELD only when another owner holds it;
* ``ack-proof`` -- a success ACK only after this attempt's own transaction committed; a
  duplicate ACK only while the committed record is completed;
* ``conservation`` -- every copy is queued, in flight, or ended (ACKed, handed off to the retry
  bucket or the DLQ); none is dropped or settled twice;
* ``bounded-requeue`` -- per record, deferred requeues stay within ``max_deferrals - 1`` plus the
  deferrals the record could not count (claim errors, releases that matched nothing);
* ``replay`` -- a transaction error that did not commit replays the attempt (docs/inbox.md, step 5) for
  exactly the replay budget, then defers;
* ``reconciliation`` -- an attempt whose commit applied is never replayed and settles as a
  success; an unknown commit result is retried, then reconciled (docs/inbox.md, step 6);
* ``liveness`` -- a claim on an absent, released or expired lease takes it; and in the
  teardown, with no more faults: in-flight attempts finish, the server aborts orphaned
  transactions, and once the clock passes every lease's expiry each remaining copy completes
  or is a duplicate (so a crashed owner's event completes after expiry); every event that was
  ACKed or still had a copy then ends completed exactly once.

Besides the random runs, ``SCENARIOS`` walk the same machine through the windows a random
run meets rarely (a stale owner exists only between its claim and its completion write).

Not modelled: replication (a majority read sees every applied commit), TTL retention of
records, the outbox, handler deadlines and cancellation windows, the backoff before a
requeue, settlement write failures other than a lost channel (test_settlement_props.py
covers those), and the MongoDB pipelines themselves (``claim_pipeline`` and the others): the
model runs their Python transitions, so it is only as true as their equivalence.

Budget: ``LILY_MODEL_EXAMPLES`` (default 250) random runs of up to ``LILY_MODEL_STEPS``
(default 30) moves each, plus the teardown's drain; ``LILY_MODEL_EXAMPLES=5000`` is the long
profile. ``LILY_MUTANTS=1`` adds the mutation run (``inbox_mutants.py``): it swaps functions
of :mod:`lily_mongo.records`, which is why the model calls them through the module.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import enum
import functools
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import event as count_event
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import lily_mongo.records as records
from lily_mongo.records import (
    COMPLETED,
    LEASED,
    TRANSIENT_LABEL,
    UNKNOWN_COMMIT_LABEL,
    ClaimKind,
    ErrorStep,
    Heartbeat,
    Reconciled,
    record_key,
)
from lily_mongo.settlement import Budget, Evidence, HandoffState, Outcome, PipelineResult, SettleState, StepKind, decide
from tests.property.inbox_mutants import MUTANTS, Mutant

EXAMPLES = int(os.environ.get("LILY_MODEL_EXAMPLES", "250"))
STEPS = int(os.environ.get("LILY_MODEL_STEPS", "30"))
MODEL = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

HANDLER = "orders.v1"
EPOCH = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)
STALE_SECONDS = 60.0
RETENTION_SECONDS = 3600.0
SHARED_DOC = "ledger:all"
DRAIN_GUARD = 3000
MAX_REPUBLISHED = 4  # extra copies per run
MAX_SERVER_ABORTS = 2  # per run: enough to orphan or interrupt, few enough to let attempts commit


class InvariantViolation(AssertionError):
    """A model invariant failed; ``invariant`` names it."""

    def __init__(self, invariant: str, message: str, trace: list[str]) -> None:
        recent = "\n  ".join(trace[-40:])
        super().__init__(f"[{invariant}] {message}\nwhat happened (most recent last):\n  {recent}")
        self.invariant = invariant


# -- the simulated MongoDB -------------------------------------------------------------------


class MongoError(Exception):
    """A failed operation and its error labels (the consumer classifies by label only)."""

    def __init__(self, what: str, labels: frozenset[str]) -> None:
        super().__init__(what)
        self.what = what
        self.labels = labels


TRANSIENT = frozenset({TRANSIENT_LABEL})
UNKNOWN = frozenset({UNKNOWN_COMMIT_LABEL})
NO_LABELS: frozenset[str] = frozenset()


class TxnState(enum.Enum):
    OPEN = "open"
    COMMITTED = "committed"
    ABORTED = "aborted"


Doc = dict[str, Any]


@dataclass(eq=False)
class Txn:
    tid: int
    owner: Handling
    snapshot: dict[str, Doc] | None = None  # committed documents as of the first operation
    snapshot_version: int = 0
    writes: dict[str, Doc] = field(default_factory=dict)
    state: TxnState = TxnState.OPEN
    commit_in_flight: bool = False  # a commit was sent; its reply was lost before the server applied it


class Mongo:
    """Committed documents, per-document versions, and transactions with snapshot reads."""

    def __init__(self) -> None:
        self.docs: dict[str, Doc] = {}
        self.versions: dict[str, int] = {}
        self.version = 0
        self.txns: list[Txn] = []

    def holder(self, key: str) -> Txn | None:
        """The open transaction that has written ``key`` (others' writes to it wait or conflict)."""
        return next((t for t in self.txns if t.state is TxnState.OPEN and key in t.writes), None)

    def read(self, key: str) -> Doc | None:
        """A majority read: the committed document (no replication lag in this model)."""
        doc = self.docs.get(key)
        return copy.deepcopy(doc) if doc is not None else None

    def _put(self, key: str, doc: Doc | None) -> None:
        self.version += 1
        self.versions[key] = self.version
        if doc is None:
            self.docs.pop(key, None)
        else:
            self.docs[key] = copy.deepcopy(doc)

    def update(self, key: str, change: Callable[[Doc | None], Doc | None]) -> tuple[Doc | None, Doc | None]:
        """A non-transactional atomic update; the caller checks it is not blocked."""
        assert self.holder(key) is None, f"{key} is held by an open transaction: the write must wait"
        before = self.read(key)
        after = change(copy.deepcopy(before))
        if after != before:  # MongoDB skips no-op updates: no new version
            self._put(key, after)
        return before, copy.deepcopy(after)

    def begin(self, owner: Handling) -> Txn:
        txn = Txn(tid=len(self.txns) + 1, owner=owner)
        self.txns.append(txn)
        return txn

    def txn_update(
        self, txn: Txn, key: str, change: Callable[[Doc | None], Doc | None]
    ) -> tuple[Doc | None, Doc | None]:
        """A write inside ``txn``; ``change`` returns None when its filter matches nothing."""
        if txn.state is not TxnState.OPEN:
            raise MongoError("NoSuchTransaction (the server aborted it)", TRANSIENT)
        if txn.snapshot is None:
            txn.snapshot = copy.deepcopy(self.docs)
            txn.snapshot_version = self.version
        view = txn.writes.get(key, txn.snapshot.get(key))
        before = copy.deepcopy(view)
        after = change(copy.deepcopy(view))
        if after is None:
            return before, None  # nothing matched: nothing written, no conflict
        other = self.holder(key)
        if (other is not None and other is not txn) or self.versions.get(key, 0) > txn.snapshot_version:
            txn.state = TxnState.ABORTED  # a write conflict aborts the transaction
            raise MongoError(f"WriteConflict on {key}", TRANSIENT)
        txn.writes[key] = copy.deepcopy(after)
        return before, after

    def commit(self, txn: Txn) -> None:
        assert txn.state is TxnState.OPEN
        for key, doc in txn.writes.items():
            self._put(key, doc)
        txn.state = TxnState.COMMITTED
        txn.commit_in_flight = False

    def abort(self, txn: Txn) -> None:
        if txn.state is TxnState.OPEN:
            txn.state = TxnState.ABORTED
            txn.commit_in_flight = False


# -- the broker and the consumers ---------------------------------------------------------------


class Fault(enum.Enum):
    """What goes wrong at one step (its meaning depends on the step)."""

    def __repr__(self) -> str:
        return f"Fault.{self.name}"

    NONE = "none"
    TRANSIENT = "transient"  # an operation or commit fails, not applied, labelled TransientTransactionError
    ERROR = "error"  # an operation fails without labels (server unreachable, refused)
    UNKNOWN_APPLIED = "unknown_applied"  # the commit applied; its reply was lost
    UNKNOWN_PENDING = "unknown_pending"  # the commit's reply was lost before the server applied it
    RETRYABLE = "retryable"  # the handler raised a retryable failure
    PERMANENT = "permanent"  # the handler raised a permanent failure
    CHANNEL_LOST = "channel_lost"  # the delivery's channel closed before its settlement
    CRASH = "crash"  # the consumer crashes instead of taking this step


class Phase(enum.Enum):
    FIRST = "first"  # a first-time copy: fresh transaction; first operation: the claim that is the completion
    CLAIM = "claim"
    COMPLETION = "completion"  # fresh transaction; first operation: the fenced completion write
    WRITE = "write"  # the handler's next business write
    COMMIT = "commit"
    COMMIT_RETRY = "commit_retry"
    RECONCILE = "reconcile"
    RELEASE = "release"
    SETTLE = "settle"
    DONE = "done"
    CRASHED = "crashed"


LEASE_PHASES = frozenset({Phase.COMPLETION, Phase.WRITE, Phase.COMMIT, Phase.COMMIT_RETRY, Phase.RECONCILE})
# Where each fault strikes (a step it does not apply to runs cleanly).
STRIKES: dict[Fault, frozenset[Phase]] = {
    Fault.TRANSIENT: frozenset({Phase.FIRST, Phase.COMPLETION, Phase.WRITE, Phase.COMMIT, Phase.COMMIT_RETRY}),
    Fault.ERROR: frozenset({Phase.FIRST, Phase.CLAIM, Phase.COMPLETION, Phase.WRITE, Phase.COMMIT, Phase.RELEASE}),
    Fault.UNKNOWN_APPLIED: frozenset({Phase.COMMIT, Phase.COMMIT_RETRY}),
    Fault.UNKNOWN_PENDING: frozenset({Phase.COMMIT, Phase.COMMIT_RETRY}),
    Fault.RETRYABLE: frozenset({Phase.WRITE, Phase.COMMIT}),
    Fault.PERMANENT: frozenset({Phase.WRITE, Phase.COMMIT}),
    Fault.CHANNEL_LOST: frozenset({Phase.SETTLE}),
}
DRIVING = frozenset({Phase.WRITE, Phase.COMMIT, Phase.COMMIT_RETRY, Phase.RECONCILE})
ENDED = frozenset({Phase.DONE, Phase.CRASHED})
# The drain finishes open transactions before starting new ones.
DRAIN_ORDER = [
    Phase.COMMIT_RETRY,
    Phase.COMMIT,
    Phase.WRITE,
    Phase.RECONCILE,
    Phase.RELEASE,
    Phase.SETTLE,
    Phase.COMPLETION,
    Phase.FIRST,
    Phase.CLAIM,
]


class MsgState(enum.Enum):
    QUEUED = "queued"
    IN_FLIGHT = "in_flight"
    ENDED = "ended"


@dataclass(eq=False)
class Message:
    mid: int
    event: str
    retry_count: int = 0
    state: MsgState = MsgState.QUEUED
    deliveries: int = 0
    terminal: str | None = None


@dataclass(eq=False)
class Handling:
    """One consumer handling one delivery (one claim, then attempts)."""

    hid: int
    consumer: int
    msg: Message
    owner: str
    key: str
    phase: Phase = Phase.CLAIM
    token: int = 0
    attempts: int = 0
    replays: int = 0
    write: int = 0
    txn: Txn | None = None
    txns: list[Txn] = field(default_factory=list)
    holding: bool = False  # its transaction has written the record and not yet ended (as it knows)
    lost: bool = False
    renewed_at: int = 0
    commit_retries: int = 0
    result: PipelineResult | None = None
    release_deferred: bool = True
    deferrals: int = 0
    counted: bool = False  # its deferral was counted in the record by its own write
    incarnation: int = 0
    fresh_in_drain: bool = False
    first: bool = False  # claiming inside the transaction: no lease, nothing to renew or release

    @property
    def name(self) -> str:
        return f"c{self.consumer}/h{self.hid}({self.msg.event}#m{self.msg.mid})"

    def committed(self) -> bool:
        return any(t.state is TxnState.COMMITTED for t in self.txns)


@dataclass(frozen=True)
class EventSpec:
    name: str
    copies: int
    writes: tuple[str, ...]  # the documents the handler writes, in order


@dataclass(frozen=True)
class Config:
    events: tuple[EventSpec, ...]
    consumers: int
    lease_seconds: int
    max_deferrals: int
    replay_budget: int
    commit_retries: int
    max_retries: int
    claim_in_transaction: bool = True


@st.composite
def configs(draw: st.DrawFn) -> Config:
    events = []
    for i in range(draw(st.integers(1, 2), label="events")):
        name = f"e{i + 1}"
        targets = draw(st.lists(st.sampled_from([f"ledger:{name}", SHARED_DOC]), max_size=2), label="writes")
        events.append(EventSpec(name, draw(st.integers(1, 3), label="copies"), tuple(targets)))
    return Config(
        events=tuple(events),
        consumers=draw(st.integers(2, 3), label="consumers"),
        lease_seconds=draw(st.integers(1, 3), label="lease_seconds"),
        max_deferrals=draw(st.integers(1, 4), label="max_deferrals"),
        replay_budget=draw(st.integers(0, 2), label="replay_budget"),
        commit_retries=draw(st.sampled_from([0, 1, 0, 2]), label="commit_retries"),
        max_retries=draw(st.integers(0, 1), label="max_retries"),
        claim_in_transaction=draw(st.booleans(), label="claim_in_transaction"),
    )


@dataclass(frozen=True)
class Step:
    """Run a handling (``pick`` among those that can move) for up to ``steps`` steps; ``fault`` strikes once."""

    pick: int
    steps: int
    fault: Fault


@dataclass(frozen=True)
class Deliver:
    """The broker delivers the queue's head to a consumer."""

    consumer: int


@dataclass(frozen=True)
class Beat:
    """A heartbeat of an attempt holding a lease; ``fails``: the renewal gets no answer."""

    pick: int
    fails: bool


@dataclass(frozen=True)
class Wait:
    """Server time passes; with ``beats``, every running attempt's heartbeat timer then fires."""

    seconds: int
    beats: bool


@dataclass(frozen=True)
class ServerEvent:
    """The server aborts an open transaction, or a commit whose reply was lost applies late."""

    pick: int


@dataclass(frozen=True)
class Republish:
    """The publisher sends another copy of an event."""

    pick: int


Move = Step | Deliver | Beat | Wait | ServerEvent | Republish

picks = st.integers(0, 11)
# A third of the steps clean, so the long paths are reached; NONE first so failures shrink to it.
# The commit's two unknown results count double: reconciliation is the deepest path.
faults = st.sampled_from(
    [Fault.NONE] * 5 + [f for f in Fault if f is not Fault.NONE] + [Fault.UNKNOWN_APPLIED, Fault.UNKNOWN_PENDING]
)
steps = st.builds(Step, pick=picks, steps=st.integers(1, 6), fault=faults)
# Weights by repetition: protocol steps a third of the time, deliveries a sixth.
moves: st.SearchStrategy[Move] = st.one_of(
    steps,
    st.builds(Deliver, consumer=st.integers(0, 2)),
    steps,
    st.builds(Wait, seconds=st.integers(1, 4), beats=st.booleans()),
    steps,
    st.builds(Beat, pick=picks, fails=st.booleans()),
    st.builds(Deliver, consumer=st.integers(0, 2)),
    st.builds(ServerEvent, pick=picks),
    st.builds(Republish, pick=picks),
)


def fenced_for(record: Doc | None, h: Handling) -> bool:
    """The fence, stated independently: the record is still leased to this (owner, token)."""
    return (
        record is not None
        and record.get("state") == LEASED
        and record.get("owner") == h.owner
        and record.get("token") == h.token
    )


def brief(doc: Doc | None) -> str:
    """A record as the trace shows it: its protocol fields, times as t=<seconds>."""
    if doc is None:
        return "absent"
    fields = []
    for name in ("state", "owner", "token", "expires_at", "deferrals"):
        value = doc.get(name)
        if isinstance(value, datetime.datetime):
            value = f"t={(value - EPOCH).total_seconds():.0f}"
        if name in doc:
            fields.append(f"{name}={value}")
    return "{" + ", ".join(fields) + "}"


class InboxModel(RuleBasedStateMachine):
    """Consumers, a broker and a MongoDB, driven one protocol step at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.cfg: Config | None = None
        self.mongo = Mongo()
        self.clock = 0
        self.queue: list[Message] = []
        self.messages: list[Message] = []
        self.handlings: list[Handling] = []
        self.trace: list[str] = []
        self.specs: dict[str, EventSpec] = {}
        self.completions: Counter[str] = Counter()
        self.completion_txn: dict[str, int] = {}
        self.incarnation: Counter[str] = Counter()
        self.requeued: Counter[tuple[str, int]] = Counter()
        self.uncounted: Counter[tuple[str, int]] = Counter()
        self.acked: set[str] = set()
        self.draining = False
        self.aborts = 0
        self.republished = 0

    # -- helpers -------------------------------------------------------------------------------

    @property
    def now(self) -> datetime.datetime:
        return EPOCH + datetime.timedelta(seconds=self.clock)

    def log(self, line: str) -> None:
        self.trace.append(f"t={self.clock} {line}")

    def reached(self, situation: str) -> None:
        """Count a situation the model reached (pytest --hypothesis-show-statistics)."""
        if not self.draining and currently_in_test_context():
            count_event(situation)

    def expect(self, ok: object, invariant_: str, message: str) -> None:
        if not ok:
            raise InvariantViolation(invariant_, message, self.trace)

    def config(self) -> Config:
        assert self.cfg is not None
        return self.cfg

    def key_of(self, event: str) -> str:
        return record_key(HANDLER, event)

    def live(self) -> list[Handling]:
        return [h for h in self.handlings if h.phase not in ENDED]

    def enabled(self, h: Handling) -> bool:
        """Claims and releases are non-transactional writes: they wait for a transaction holding the record."""
        if h.phase in (Phase.CLAIM, Phase.RELEASE):
            return self.mongo.holder(h.key) is None
        return h.phase not in ENDED

    def open_txns(self) -> list[Txn]:
        return [t for t in self.mongo.txns if t.state is TxnState.OPEN]

    def driven(self, txn: Txn) -> bool:
        """Will a live consumer still commit or abort this transaction?"""
        h = txn.owner
        return h.phase in DRIVING and h.txn is txn

    # -- rules ---------------------------------------------------------------------------------

    @initialize(cfg=configs())
    def start(self, cfg: Config) -> None:
        self.cfg = cfg
        for spec in cfg.events:
            self.specs[spec.name] = spec
            for _ in range(spec.copies):
                self.publish(spec.name, retry_count=0)
        self.log(f"published {len(self.messages)} copies; {cfg}")

    # One rule, whose argument says what happens next. (Several rules would let hypothesis's
    # swarm testing switch the protocol steps off for a whole run, a third of the runs.)
    @rule(move=moves)
    def act(self, move: Move) -> None:
        match move:
            case Step():
                self.advance(move)
            case Deliver(consumer=consumer):
                if self.queue:
                    self.deliver(consumer % self.config().consumers)
            case Beat():
                self.heartbeat(move)
            case Wait(seconds=seconds, beats=beats):
                self.clock += seconds
                self.log(f"{seconds}s pass")
                for h in self.beating() if beats else []:
                    self.renew(h, fails=False)
            case ServerEvent(pick=pick):
                self.server(pick)
            case Republish(pick=pick):
                self.republish(pick)

    def publish(self, event: str, *, retry_count: int) -> Message:
        msg = Message(mid=len(self.messages) + 1, event=event, retry_count=retry_count)
        self.messages.append(msg)
        self.queue.append(msg)
        return msg

    def advance(self, move: Step) -> None:
        """Run one handling for up to ``move.steps`` protocol steps.

        The fault strikes the first of them where it applies (see ``STRIKES``) and ends the run;
        a crash strikes instead of the last step. Anything else can happen between two steps,
        as ``steps`` shrinks to 1.
        """
        ready = [h for h in self.live() if self.enabled(h)]
        if not ready:
            return
        h = ready[move.pick % len(ready)]
        for n in range(move.steps, 0, -1):
            if not self.enabled(h):
                return
            if move.fault is Fault.CRASH and n == 1:
                self.reached(f"consumer crash before {h.phase.value}")
                self.crash(h.consumer)
                return
            if h.phase in STRIKES.get(move.fault, ()):
                self.step(h, move.fault)
                return
            self.step(h, Fault.NONE)

    def beating(self) -> list[Handling]:
        return [h for h in self.live() if h.phase in LEASE_PHASES and not h.lost and not h.first]

    def heartbeat(self, move: Beat) -> None:
        beating = self.beating()
        if beating:
            self.renew(beating[move.pick % len(beating)], fails=move.fails)

    def renew(self, h: Handling, *, fails: bool) -> None:
        """A heartbeat between two steps of an attempt (docs/inbox.md, step 4)."""
        if not records.may_renew(holding=h.holding):
            self.log(f"{h.name} heartbeat skipped: its transaction holds the record")
            return
        holder = self.mongo.holder(h.key)
        if fails:
            matched: bool | None = None
        elif holder is not None:
            # The renewal waits for the transaction holding the record: it lands later,
            # which a later heartbeat models, so nothing happens now.
            self.log(f"{h.name} renewal waits for txn {holder.tid} of {holder.owner.name}")
            self.reached("renewal waits for a transaction")
            return
        else:
            cfg = self.config()
            result: list[Doc | None] = []

            def renew(record: Doc | None) -> Doc | None:
                after = records.renewal_transition(
                    record,
                    h.owner,
                    h.token,
                    now=self.now,
                    lease_seconds=cfg.lease_seconds,
                    stale_seconds=STALE_SECONDS,
                )
                result.append(after)
                return after if after is not None else record

            before, after = self.mongo.update(h.key, renew)
            matched = result[0] is not None
            if not fenced_for(before, h):
                self.reached("renewal by a stale owner")
                changed = f"{h.name}'s renewal with a stale token changed {brief(before)} to {brief(after)}"
                self.expect(after == before, "fencing", changed)
        verdict = records.heartbeat_verdict(
            matched=matched, unrenewed_for=float(self.clock - h.renewed_at), lease_seconds=self.config().lease_seconds
        )
        if matched:
            h.renewed_at = self.clock
        self.log(f"{h.name} renewal matched={matched} -> {verdict.value}")
        if verdict is Heartbeat.LOST:
            self.reached("heartbeat: lease lost")
            h.lost = True

    def server(self, pick: int) -> None:
        """The server aborts an open transaction (lifetime limit, failover), or a delayed commit applies."""
        txns = self.open_txns()
        options = [("late_commit", t) for t in txns if t.commit_in_flight]
        if self.aborts < MAX_SERVER_ABORTS:
            options += [("abort", t) for t in txns]
        if not options:
            return
        kind, txn = options[pick % len(options)]
        self.reached(f"server: {kind}")
        if kind == "abort":
            self.aborts += 1
            self.mongo.abort(txn)
            self.log(f"server aborts txn {txn.tid} of {txn.owner.name}")
        else:
            self.mongo.commit(txn)
            self.on_commit(txn)
            self.log(f"the delayed commit of txn {txn.tid} ({txn.owner.name}) arrives and applies")

    def republish(self, pick: int) -> None:
        """The publisher sends another copy of an event (at-least-once publishing, a retried publish)."""
        if self.republished >= MAX_REPUBLISHED:
            return
        event = self.config().events[pick % len(self.config().events)].name
        self.republished += 1
        msg = self.publish(event, retry_count=0)
        self.log(f"another copy of {event} is published (m{msg.mid})")

    # -- broker --------------------------------------------------------------------------------

    def deliver(self, consumer: int, *, fresh_in_drain: bool = False) -> Handling:
        msg = self.queue.pop(0)
        msg.state = MsgState.IN_FLIGHT
        msg.deliveries += 1
        hid = len(self.handlings) + 1
        # The broker's redelivered flag: set on every delivery of a copy after its first.
        first = self.config().claim_in_transaction and records.claims_in_transaction(
            redelivered=msg.deliveries > 1, delivery_count=msg.deliveries - 1
        )
        h = Handling(
            hid=hid,
            consumer=consumer,
            msg=msg,
            owner=f"c{consumer}:{hid}",  # one owner id per claim, as inbox.py numbers them per process
            key=self.key_of(msg.event),
            fresh_in_drain=fresh_in_drain,
            phase=Phase.FIRST if first else Phase.CLAIM,
            first=first,
        )
        self.handlings.append(h)
        how = ", claims in its transaction" if first else ""
        self.log(f"{h.name} delivered (delivery {msg.deliveries} of m{msg.mid}{how})")
        return h

    def requeue(self, msg: Message) -> None:
        msg.state = MsgState.QUEUED
        self.queue.append(msg)

    def crash(self, consumer: int) -> None:
        for h in self.live():
            if h.consumer == consumer:
                h.phase = Phase.CRASHED
                self.requeue(h.msg)  # unacked: the broker redelivers it
        self.log(f"consumer c{consumer} crashes; its unacked deliveries return to the queue")

    # -- one protocol step ---------------------------------------------------------------------

    def step(self, h: Handling, fault: Fault) -> None:
        assert self.enabled(h)
        {
            Phase.FIRST: self.first_claim,
            Phase.CLAIM: self.claim,
            Phase.COMPLETION: self.completion,
            Phase.WRITE: self.handler_write,
            Phase.COMMIT: self.commit,
            Phase.COMMIT_RETRY: self.commit_retry,
            Phase.RECONCILE: self.reconcile,
            Phase.RELEASE: self.release,
            Phase.SETTLE: self.settle,
        }[h.phase](h, fault)

    def verdict(self, h: Handling, result: PipelineResult, *, release: bool | None) -> None:
        """The attempt's conclusion; ``release``: deferred (True), final (False), nothing (None)."""
        if h.committed():
            self.expect(
                result.outcome is Outcome.SUCCESS,
                "reconciliation",
                f"{h.name}'s own commit applied, yet it concluded {result.outcome.value} ({result.code})",
            )
        if result.outcome is Outcome.SUCCESS:
            self.expect(h.committed(), "ack-proof", f"{h.name} concluded success without its commit applied")
        h.result = result
        h.holding = False
        self.log(f"{h.name} concludes {result.outcome.value} {result.code or ''}".rstrip())
        if h.first and result.outcome is Outcome.DEFERRED:
            # No record of its own to count the deferral in: the runtime's counts bound it.
            h.deferrals, h.counted, h.incarnation = 0, False, self.incarnation[h.msg.event]
        if release is None or h.first:  # a first-time claim leaves nothing to release
            h.phase = Phase.SETTLE
        else:
            h.release_deferred = release
            h.phase = Phase.RELEASE

    def defer_without_release(self, h: Handling, code: str, *, deferrals: int, counted: bool) -> None:
        h.deferrals, h.counted, h.incarnation = deferrals, counted, self.incarnation[h.msg.event]
        self.verdict(h, PipelineResult(Outcome.DEFERRED, code), release=None)

    def begin_attempt(self, h: Handling, fault: Fault, first_write: str) -> Txn | None:
        """A fresh attempt's transaction, or None when ``fault`` failed its first write (handled)."""
        h.attempts += 1
        cfg = self.config()
        self.expect(h.attempts <= cfg.replay_budget + 1, "replay", f"{h.name} starts attempt {h.attempts}")
        txn = self.mongo.begin(h)
        h.txn = txn
        h.txns.append(txn)
        if fault not in (Fault.TRANSIENT, Fault.ERROR):
            return txn
        self.mongo.abort(txn)
        labels = TRANSIENT if fault is Fault.TRANSIENT else NO_LABELS
        self.error(h, labels, in_commit=False, what=f"{first_write} failed {sorted(labels)}")
        return None

    def take_lease_path(self, h: Handling) -> None:
        """A first-time copy's replay, or its record contended: the lease claim, as a new owner."""
        h.first = False
        h.owner = f"{h.owner}L"
        h.phase = Phase.CLAIM
        self.log(f"{h.name} takes the lease claim as {h.owner}")

    def first_claim_failed(self, h: Handling, txn: Txn, exc: MongoError) -> None:
        """The claim in the transaction failed: the lease claim, or the error path of any operation."""
        if not records.first_claim_falls_back(exc.labels):
            self.error(h, exc.labels, in_commit=False, what=exc.what)
            return
        self.mongo.abort(txn)
        h.attempts -= 1  # no handler ran: not an attempt, not a replay
        self.log(f"{h.name} {exc.what}: no handler ran")
        self.take_lease_path(h)

    def first_claim(self, h: Handling, fault: Fault) -> None:
        """The claim inside a fresh transaction (its first write): insert the record completed, or find it."""
        txn = self.begin_attempt(h, Fault.NONE, "claim in the transaction")
        assert txn is not None
        if fault in (Fault.TRANSIENT, Fault.ERROR):
            labels = TRANSIENT if fault is Fault.TRANSIENT else NO_LABELS
            self.mongo.abort(txn)
            self.first_claim_failed(h, txn, MongoError(f"claim in the transaction failed {sorted(labels)}", labels))
            return
        try:
            before, after = self.mongo.txn_update(
                txn,
                h.key,
                lambda record: records.first_claim_transition(
                    record,
                    key=h.key,
                    handler_id=HANDLER,
                    event_id=h.msg.event,
                    owner=h.owner,
                    now=self.now,
                    retention_seconds=RETENTION_SECONDS,
                ),
            )
        except MongoError as exc:
            self.reached("claim in the transaction: write conflict")
            self.first_claim_failed(h, txn, exc)
            return
        self.expect(
            before is None or after is None,
            "exclusive-lease",
            f"{h.name}'s claim in its transaction overwrote {brief(before)} with {brief(after)}",
        )
        found = records.read_first_claim(before)
        self.log(f"{h.name} claims {h.key} in txn {txn.tid}: {found.value} (found {brief(before)})")
        self.reached(f"claim in the transaction: {found.value}")
        if found is records.FirstClaim.CLAIMED:
            written = after is not None and after.get("state") == COMPLETED and after.get("owner") == h.owner
            self.expect(
                before is None and written, "claim-reading", f"{h.name} read {brief(before)} as absent and claimed it"
            )
            h.token = int(after.get("token", 0)) if after is not None else 0
            h.holding = True
            h.write = 0
            h.phase = Phase.WRITE if self.specs[h.msg.event].writes else Phase.COMMIT
            return
        # The inbox commits the read-only transaction on a duplicate (its majority commit waits
        # for the snapshot to be majority-committed): with no replication here, an abort.
        self.mongo.abort(txn)
        if found is records.FirstClaim.DUPLICATE:
            self.expect(
                before is not None and before.get("state") == COMPLETED,
                "claim-reading",
                f"{h.name} read {brief(before)} as a duplicate",
            )
            self.verdict(h, PipelineResult(Outcome.DUPLICATE), release=None)
            return
        self.expect(
            before is not None and before.get("state") != COMPLETED,
            "claim-reading",
            f"{h.name} read {brief(before)} as a lease record",
        )
        h.attempts -= 1
        self.take_lease_path(h)

    def claim(self, h: Handling, fault: Fault) -> None:
        cfg = self.config()
        if fault is Fault.ERROR:
            self.log(f"{h.name} claim fails: server unreachable, nothing written")
            self.defer_without_release(h, "MONGO_UNAVAILABLE", deferrals=0, counted=False)
            return

        def claim(record: Doc | None) -> Doc | None:
            return records.claim_transition(
                record,
                key=h.key,
                handler_id=HANDLER,
                event_id=h.msg.event,
                owner=h.owner,
                now=self.now,
                lease_seconds=cfg.lease_seconds,
                stale_seconds=STALE_SECONDS,
            )

        before, after = self.mongo.update(h.key, claim)
        assert after is not None
        self.check_claim(h, before, after)
        got = records.read_claim(after, h.owner)
        self.log(f"{h.name} claims {h.key}: {got.kind.value} token={got.token} (record owner {after.get('owner')})")
        self.reached(f"claim: {got.kind.value}")
        if got.kind is ClaimKind.LEASED and before is not None and before.get("owner") is not None:
            self.reached("claim: takes over an expired lease")
        if got.kind is ClaimKind.DUPLICATE:
            self.expect(
                after.get("state") == COMPLETED, "claim-reading", f"{h.name} read {brief(after)} as a duplicate"
            )
            self.verdict(h, PipelineResult(Outcome.DUPLICATE), release=None)
        elif got.kind is ClaimKind.HELD:
            held = after.get("state") == LEASED and after.get("owner") not in (None, h.owner)
            self.expect(held, "claim-reading", f"{h.name} read {brief(after)} as held by another owner")
            self.defer_without_release(h, "LEASE_HELD", deferrals=got.deferrals, counted=True)
        else:
            mine = after.get("state") == LEASED and after.get("owner") == h.owner and after.get("token") == got.token
            self.expect(mine, "claim-reading", f"{h.name} read {brief(after)} as leased to it with token {got.token}")
            h.token = got.token
            h.renewed_at = self.clock
            h.phase = Phase.COMPLETION

    def check_claim(self, h: Handling, before: Doc | None, after: Doc) -> None:
        """The claim as docs/inbox.md (step 1) states it: completed stays completed, a live lease stays its owner's,
        and anything else (absent, released, expired on the server clock) is leased to the claimant."""
        if before is not None and before.get("state") == COMPLETED:
            self.expect(
                after == before, "exclusive-lease", f"{h.name}'s claim changed a completed record to {brief(after)}"
            )
            return
        expires = None if before is None or before.get("owner") is None else before.get("expires_at")
        if expires is None or expires <= self.now:
            taken = after.get("state") == LEASED and after.get("owner") == h.owner
            self.expect(
                taken,
                "liveness",
                f"{h.name}'s claim at t={self.clock} left the free lease {brief(before)}: {brief(after)}",
            )
            return
        if before is not None:
            kept = after.get("owner") == before.get("owner") and after.get("token") == before.get("token")
            self.expect(
                kept,
                "exclusive-lease",
                f"{h.name}'s claim at t={self.clock} took the live lease {brief(before)}: {brief(after)}",
            )

    def completion(self, h: Handling, fault: Fault) -> None:
        if h.lost:
            self.lose(h)
            return
        txn = self.begin_attempt(h, fault, "completion write")
        if txn is None:
            return
        try:
            before, after = self.mongo.txn_update(
                txn,
                h.key,
                lambda record: records.completion_transition(
                    record, h.owner, h.token, now=self.now, retention_seconds=RETENTION_SECONDS
                ),
            )
        except MongoError as exc:
            self.error(h, exc.labels, in_commit=False, what=exc.what)
            return
        if after is None:
            self.log(f"{h.name} attempt {h.attempts} (txn {txn.tid}): the fenced completion matched nothing")
            self.reached("completion: fence matched nothing")
            self.mongo.abort(txn)
            self.verdict(h, PipelineResult(Outcome.DEFERRED, "LEASE_LOST"), release=True)
            return
        self.expect(
            fenced_for(before, h), "fencing", f"{h.name}'s completion (token {h.token}) matched {brief(before)}"
        )
        h.holding = True
        h.write = 0
        h.phase = Phase.WRITE if self.specs[h.msg.event].writes else Phase.COMMIT
        self.log(f"{h.name} attempt {h.attempts} (txn {txn.tid}) wrote the completion first: it holds {h.key}")

    def lose(self, h: Handling) -> None:
        if h.txn is not None:
            self.mongo.abort(h.txn)
        self.log(f"{h.name} stops: the heartbeat reported the lease lost")
        self.verdict(h, PipelineResult(Outcome.DEFERRED, "LEASE_LOST"), release=True)

    def handler_fails(self, h: Handling, fault: Fault) -> None:
        assert h.txn is not None
        self.mongo.abort(h.txn)
        outcome = Outcome.RETRYABLE if fault is Fault.RETRYABLE else Outcome.PERMANENT
        self.reached("handler failure")
        self.log(f"{h.name} handler raises a {outcome.value} failure; txn {h.txn.tid} aborted")
        self.verdict(h, PipelineResult(outcome, "PAYMENT_DOWN"), release=False)

    def handler_write(self, h: Handling, fault: Fault) -> None:
        if h.lost:
            self.lose(h)
            return
        if fault in (Fault.RETRYABLE, Fault.PERMANENT):
            self.handler_fails(h, fault)
            return
        txn = h.txn
        assert txn is not None
        if fault in (Fault.TRANSIENT, Fault.ERROR):
            self.mongo.abort(txn)
            labels = TRANSIENT if fault is Fault.TRANSIENT else NO_LABELS
            self.error(h, labels, in_commit=False, what=f"handler write failed {sorted(labels)}")
            return
        doc_key = self.specs[h.msg.event].writes[h.write]
        entry = [h.msg.event, h.write, txn.tid]

        def append(doc: Doc | None) -> Doc:
            doc = doc or {"_id": doc_key, "entries": []}
            doc["entries"] = [*doc["entries"], entry]
            return doc

        try:
            self.mongo.txn_update(txn, doc_key, append)
        except MongoError as exc:
            self.error(h, exc.labels, in_commit=False, what=exc.what)
            return
        self.log(f"{h.name} handler write {h.write} to {doc_key} in txn {txn.tid}")
        h.write += 1
        if h.write == len(self.specs[h.msg.event].writes):
            h.phase = Phase.COMMIT

    def commit(self, h: Handling, fault: Fault) -> None:
        if h.lost:
            self.lose(h)
            return
        if fault in (Fault.RETRYABLE, Fault.PERMANENT):
            self.handler_fails(h, fault)
            return
        self.send_commit(h, fault, retry=False)

    def commit_retry(self, h: Handling, fault: Fault) -> None:
        h.commit_retries += 1
        self.send_commit(h, fault, retry=True)

    def send_commit(self, h: Handling, fault: Fault, *, retry: bool) -> None:
        txn = h.txn
        assert txn is not None
        what = "commit retry" if retry else "commit"
        if txn.state is TxnState.COMMITTED:  # only a retry can find it applied
            if fault in (Fault.UNKNOWN_APPLIED, Fault.UNKNOWN_PENDING):
                self.error(h, UNKNOWN, in_commit=True, what=f"{what} of txn {txn.tid}: reply lost again")
            else:
                self.log(f"{h.name} {what} of txn {txn.tid}: already applied, the server says ok")
                self.verdict(h, PipelineResult(Outcome.SUCCESS), release=None)
            return
        if txn.state is TxnState.ABORTED:
            self.error(h, TRANSIENT, in_commit=True, what=f"{what} of txn {txn.tid}: NoSuchTransaction")
            return
        if fault is Fault.TRANSIENT:
            self.mongo.abort(txn)
            self.error(h, TRANSIENT, in_commit=True, what=f"{what} of txn {txn.tid} failed, not applied")
        elif fault is Fault.ERROR and not retry:
            self.mongo.abort(txn)
            self.error(h, NO_LABELS, in_commit=True, what=f"{what} of txn {txn.tid} failed without labels")
        elif fault is Fault.UNKNOWN_APPLIED:
            self.mongo.commit(txn)
            self.on_commit(txn)
            self.error(h, UNKNOWN, in_commit=True, what=f"{what} of txn {txn.tid} applied, reply lost")
        elif fault is Fault.UNKNOWN_PENDING:
            txn.commit_in_flight = True
            self.error(h, UNKNOWN, in_commit=True, what=f"{what} of txn {txn.tid} in flight, reply lost")
        else:
            self.mongo.commit(txn)
            self.on_commit(txn)
            self.log(f"{h.name} {what} of txn {txn.tid}: committed")
            self.verdict(h, PipelineResult(Outcome.SUCCESS), release=None)

    def on_commit(self, txn: Txn) -> None:
        for key, doc in txn.writes.items():
            if key.startswith(HANDLER) and doc.get("state") == COMPLETED:
                event = doc["event_id"]
                self.completions[event] += 1
                self.completion_txn[event] = txn.tid
                self.expect(
                    self.completions[event] == 1,
                    "at-most-once",
                    f"{event} completed a second time by txn {txn.tid} of {txn.owner.name}",
                )

    def error(self, h: Handling, labels: frozenset[str], *, in_commit: bool, what: str) -> None:
        """A labelled database error inside an attempt: retry the commit, replay, or defer."""
        cfg = self.config()
        self.log(f"{h.name} {what}")
        self.reached(f"error: {what.split(' of txn')[0].split(' on ')[0]}")
        step = records.classify_error(labels, in_commit=in_commit)
        unknown = UNKNOWN_COMMIT_LABEL in labels
        not_applied = not unknown and (TRANSIENT_LABEL in labels or in_commit)
        if step is ErrorStep.RETRY_COMMIT:
            self.expect(
                not not_applied,
                "replay",
                f"{h.name}: a transaction error that did not commit ({sorted(labels)}) was treated as an unknown "
                "commit result instead of replayed",
            )
            if h.phase is not Phase.COMMIT_RETRY:
                h.commit_retries = 0
            h.phase = Phase.COMMIT_RETRY if h.commit_retries < cfg.commit_retries else Phase.RECONCILE
            return
        assert h.txn is not None
        self.expect(
            h.txn.state is not TxnState.COMMITTED,
            "reconciliation",
            f"{h.name}: txn {h.txn.tid} committed (its reply was lost) but the attempt was {step.value}ed instead of "
            "reconciled: the handler would run again to find out (docs/inbox.md, step 6)",
        )
        self.expect(
            not unknown,
            "reconciliation",
            f"{h.name}: an unknown commit result led to {step.value} instead of a commit retry and reconciliation",
        )
        self.mongo.abort(h.txn)
        h.holding = False
        if step is ErrorStep.DEFER:
            self.expect(
                not not_applied,
                "replay",
                f"{h.name}: a transaction error that did not commit ({sorted(labels)}) deferred instead of replaying",
            )
            self.verdict(h, PipelineResult(Outcome.DEFERRED, "MONGO_ERROR"), release=True)
            return
        h.replays += 1
        if records.next_after_replay(h.replays, cfg.replay_budget) is ErrorStep.REPLAY:
            self.expect(
                h.replays <= cfg.replay_budget,
                "replay",
                f"{h.name} replays again after {h.replays} replay requests, beyond the budget {cfg.replay_budget}",
            )
            self.log(f"{h.name} replays (replay {h.replays} of {cfg.replay_budget})")
            if h.first:
                self.take_lease_path(h)
                return
            h.phase = Phase.COMPLETION
            return
        self.expect(
            h.replays == cfg.replay_budget + 1,
            "replay",
            f"{h.name} deferred after {h.replays - 1} replays, with a budget of {cfg.replay_budget}",
        )
        self.verdict(h, PipelineResult(Outcome.DEFERRED, "REPLAY_BUDGET_SPENT"), release=True)

    def reconcile(self, h: Handling, fault: Fault) -> None:
        record = self.mongo.read(h.key)
        found = records.reconcile(record, h.owner, h.token)
        self.log(f"{h.name} reconciles from {brief(record)}: {found.value}")
        self.reached(f"reconcile: {found.value}")
        if found is Reconciled.COMMITTED:
            self.verdict(h, PipelineResult(Outcome.SUCCESS), release=None)
        elif found is Reconciled.DUPLICATE:
            self.verdict(h, PipelineResult(Outcome.DUPLICATE), release=None)
        else:
            self.verdict(h, PipelineResult(Outcome.DEFERRED, "COMMIT_AMBIGUOUS"), release=True)

    def release(self, h: Handling, fault: Fault) -> None:
        event = h.msg.event
        h.incarnation = self.incarnation[event]
        if fault is Fault.ERROR:
            self.log(f"{h.name} release fails: the lease is left to expire")
            h.deferrals, h.counted = 0, False
            h.phase = Phase.SETTLE
            return
        matched: list[bool] = []

        def release(record: Doc | None) -> Doc | None:
            after, hit = records.release_transition(record, h.owner, h.token, now=self.now, deferred=h.release_deferred)
            matched.append(hit)
            return after

        before, after = self.mongo.update(h.key, release)
        if not fenced_for(before, h):
            changed = f"{h.name}'s release with a stale token changed {brief(before)} to {brief(after)}"
            self.expect(after == before, "fencing", changed)
        how = "deferral" if h.release_deferred else "final"
        self.log(f"{h.name} {how} release matched={matched[0]}: {brief(after)}")
        self.reached(f"release: {how}, matched={matched[0]}")
        if before is not None and after is None:
            self.incarnation[event] += 1
        if h.release_deferred:
            if matched[0] and after is not None:
                h.deferrals, h.counted = int(after.get("deferrals", 0)), True
            else:
                h.deferrals, h.counted = int((after or {}).get("deferrals", 0)), False
        h.phase = Phase.SETTLE

    def settle(self, h: Handling, fault: Fault) -> None:
        cfg = self.config()
        assert h.result is not None
        result, msg = h.result, h.msg
        budget = Budget(
            retry_count=msg.retry_count,
            max_retries=cfg.max_retries,
            deferrals=h.deferrals,
            max_deferrals=cfg.max_deferrals,
        )
        evidence = Evidence(authority=fault is not Fault.CHANNEL_LOST)
        retry_copy: int | None = None
        for _ in range(6):
            step = decide(result, budget, evidence)
            if step.kind in (StepKind.DONE, StepKind.UNRESOLVED):
                break
            if step.kind in (StepKind.PUBLISH_RETRY, StepKind.PUBLISH_DLQ):
                if step.kind is StepKind.PUBLISH_RETRY:
                    retry_copy = step.retry_count  # the confirmed retry copy, published below
                evidence = dataclasses.replace(evidence, handoff=HandoffState.CONFIRMED)
                continue
            if step.kind is StepKind.ACK and evidence.handoff is HandoffState.NONE:
                self.check_ack(h)  # an ACK after a confirmed handoff copy proves nothing about the inbox
            evidence = dataclasses.replace(evidence, settle=SettleState.SENT, settled_with=step.kind)
        else:  # pragma: no cover - decide() ends within four steps (test_settlement_props)
            raise AssertionError("settlement did not end")
        terminal = step.terminal.value if step.terminal else "?"
        h.phase = Phase.DONE
        self.log(f"{h.name} settles {result.outcome.value}: {terminal} {step.code or ''}".rstrip())
        self.reached(f"settled: {terminal} {step.code or ''}".rstrip())
        if h.fresh_in_drain:
            self.expect(
                terminal in ("acked", "duplicate"),
                "liveness",
                f"{h.name} was delivered after every lease expired, with no open transaction and no faults, "
                f"yet ended {terminal} ({result.code})",
            )
        if terminal in ("deferred", "unresolved"):
            self.requeue(msg)
            if terminal == "deferred":
                slot = (msg.event, h.incarnation)
                self.requeued[slot] += 1
                self.uncounted[slot] += not h.counted
            return
        msg.state, msg.terminal = MsgState.ENDED, terminal
        if terminal in ("acked", "duplicate"):
            self.acked.add(msg.event)
        elif terminal == "retried":
            assert retry_copy is not None
            self.publish(msg.event, retry_count=retry_copy)
        else:
            self.expect(terminal == "dead_lettered", "conservation", f"{h.name} ended {terminal}")

    def check_ack(self, h: Handling) -> None:
        assert h.result is not None
        if h.result.outcome is Outcome.SUCCESS:
            self.expect(h.committed(), "ack-proof", f"{h.name} ACKs a success without its own commit applied")
        else:
            record = self.mongo.read(h.key)
            self.expect(
                h.result.outcome is Outcome.DUPLICATE and record is not None and record.get("state") == COMPLETED,
                "ack-proof",
                f"{h.name} ACKs {h.result.outcome.value} while the record is {brief(record)}",
            )

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def hold(self) -> None:
        self.effects_at_most_once()
        self.every_copy_accounted_for()
        self.requeues_bounded()

    def effects_at_most_once(self) -> None:
        if self.cfg is None:
            return
        entries: dict[str, list[tuple[int, int]]] = {}
        for key, doc in self.mongo.docs.items():
            if key.startswith("ledger:"):
                for event, index, tid in doc["entries"]:
                    entries.setdefault(event, []).append((index, tid))
        for event, spec in self.specs.items():
            found = sorted(entries.get(event, []))
            record = self.mongo.docs.get(self.key_of(event))
            completed = record is not None and record.get("state") == COMPLETED
            txn = self.completion_txn.get(event)
            if found or completed:
                expected = sorted((i, txn) for i in range(len(spec.writes))) if txn is not None else []
                self.expect(
                    completed and found == expected,
                    "at-most-once",
                    f"{event}: committed effects (write, txn) {found}, expected {expected} from the completing txn "
                    f"{txn}; record {brief(record)}",
                )

    def every_copy_accounted_for(self) -> None:
        in_flight = Counter(h.msg.mid for h in self.live())
        queued = Counter(m.mid for m in self.queue)
        for msg in self.messages:
            where = {MsgState.QUEUED: queued[msg.mid] == 1 and in_flight[msg.mid] == 0}
            where[MsgState.IN_FLIGHT] = queued[msg.mid] == 0 and in_flight[msg.mid] == 1
            where[MsgState.ENDED] = queued[msg.mid] == 0 and in_flight[msg.mid] == 0 and msg.terminal is not None
            self.expect(
                where[msg.state],
                "conservation",
                f"m{msg.mid} is {msg.state.value} but queued {queued[msg.mid]}x, in flight {in_flight[msg.mid]}x",
            )

    def requeues_bounded(self) -> None:
        if self.cfg is None:
            return
        bound = max(self.cfg.max_deferrals - 1, 0)
        for (event, incarnation), n in self.requeued.items():
            extra = self.uncounted[(event, incarnation)]
            self.expect(
                n <= bound + extra,
                "bounded-requeue",
                f"{event} (record incarnation {incarnation}) was requeued {n} times as deferred; "
                f"max_deferrals {self.cfg.max_deferrals} allows {bound} plus {extra} uncounted",
            )

    # -- liveness ------------------------------------------------------------------------------

    def teardown(self) -> None:
        if self.cfg is None or sys.exc_info()[0] is not None:
            return  # a step already failed: report that, not the drain
        self.drain()

    def drain(self) -> None:
        """No more faults: finish in-flight work, then run every remaining copy after expiry."""
        self.draining = True
        self.log("-- drain: no more faults; the server aborts the transactions of crashed consumers")
        for txn in self.open_txns():
            if txn.owner.phase is Phase.CRASHED:
                self.mongo.abort(txn)
        for _ in range(DRAIN_GUARD):
            live = self.live()
            if live:
                ready = [h for h in live if self.enabled(h)]
                if not ready:
                    orphans = [t for t in self.open_txns() if not self.driven(t)]
                    self.expect(orphans, "liveness", f"stuck: {[h.name for h in live]} wait with no orphan to abort")
                    for txn in orphans:
                        self.mongo.abort(txn)
                        self.log(f"server aborts orphaned txn {txn.tid} of {txn.owner.name}")
                    continue
                self.step(min(ready, key=lambda h: DRAIN_ORDER.index(h.phase)), Fault.NONE)
                continue
            for txn in self.open_txns():
                self.mongo.abort(txn)
                self.log(f"server aborts orphaned txn {txn.tid} of {txn.owner.name}")
            if not self.queue:
                break
            expiries = [d["expires_at"] for d in self.mongo.docs.values() if d.get("expires_at") is not None]
            latest = max([self.now, *expiries])
            self.clock = int((latest - EPOCH).total_seconds()) + 1
            self.deliver(0, fresh_in_drain=True)
        else:
            self.expect(False, "liveness", f"the drain did not end within {DRAIN_GUARD} steps")
        for msg in self.messages:
            self.expect(msg.state is MsgState.ENDED, "liveness", f"m{msg.mid} did not end: {msg.state.value}")
        fresh = {h.msg.event for h in self.handlings if h.fresh_in_drain}
        for event, spec in self.specs.items():
            if event in fresh or event in self.acked:
                record = self.mongo.docs.get(self.key_of(event))
                self.expect(
                    record is not None and record.get("state") == COMPLETED and self.completions[event] == 1,
                    "liveness",
                    f"{event} was ACKed or still had copies, yet ends {brief(record)} after {self.completions[event]} "
                    f"completions (writes {spec.writes})",
                )
        self.hold()


InboxModel.TestCase.settings = MODEL
# The default per-test timeout (120 s) fits the CI budget; the long profile gets more.
test_inbox_protocol_model = pytest.mark.timeout(max(120, EXAMPLES // 10))(InboxModel.TestCase)


# -- scenarios: the narrow windows, walked through on the same machine ------------------------------
#
# The random runs reach most paths within the CI budget. Three windows are narrow by design
# (the completion is the transaction's first write, so a stale owner exists only between its
# claim and that write) and a random run meets them rarely; these walk through them, with the
# same invariants and the same drain at the end.


def one_event(copies: int = 2, *, writes: tuple[str, ...] = (), **options: int) -> Config:
    """One event; first-time copies take the lease claim unless ``claim_in_transaction=True``."""
    base = {
        "claim_in_transaction": False,
        "consumers": 2,
        "lease_seconds": 2,
        "max_deferrals": 3,
        "replay_budget": 1,
        "commit_retries": 0,
        "max_retries": 0,
    }
    return Config(events=(EventSpec("e1", copies, writes),), **(base | options))


CLEAN = Fault.NONE
# h1 claims (t=0, lease until t=2) and pauses; time passes; h2 takes the expired lease over.
PAUSE_THEN_TAKEOVER: list[Move] = [
    Deliver(0),
    Step(0, 1, CLEAN),
    Wait(3, beats=False),
    Deliver(1),
    Step(1, 1, CLEAN),
    Wait(1, beats=False),
]
SCENARIOS = [
    pytest.param(
        one_event(),
        [*PAUSE_THEN_TAKEOVER, Beat(0, fails=False)],
        "c0/h1(e1#m1) renewal matched=False -> lost",
        id="stale-owner-renews",
    ),
    pytest.param(
        one_event(),
        [*PAUSE_THEN_TAKEOVER, Step(0, 3, CLEAN)],
        "c0/h1(e1#m1) deferral release matched=False",
        id="stale-owner-completes-then-releases",
    ),
    pytest.param(
        one_event(writes=("ledger:e1",)),
        # h1 writes its completion, its handler fails; before h1 releases, its lease expires and
        # h2 takes it over: h1's final (deleting) release must match nothing.
        [Deliver(0), Step(0, 3, Fault.PERMANENT), Wait(3, beats=False), Deliver(1), Step(1, 1, CLEAN)],
        "c0/h1(e1#m1) final release matched=False",
        id="stale-owner-hands-off",
    ),
    pytest.param(
        one_event(),
        # h1's commit reply is lost before the server applied it; the server then aborts it,
        # h1's lease expires, h2 completes the event; h1 reconciles: a duplicate, not its commit.
        [
            Deliver(0),
            Step(0, 3, Fault.UNKNOWN_PENDING),
            ServerEvent(1),
            Wait(3, beats=False),
            Deliver(1),
            Step(1, 4, CLEAN),
            Step(0, 1, CLEAN),
        ],
        "c0/h1(e1#m1) settles duplicate",
        id="reconcile-finds-another-completion",
    ),
    pytest.param(
        one_event(1),
        [Deliver(0), Step(0, 3, Fault.UNKNOWN_APPLIED), Step(0, 2, CLEAN)],
        "c0/h1(e1#m1) settles success: acked",
        id="commit-applied-reply-lost",
    ),
    pytest.param(
        one_event(1, commit_retries=1),
        # The reply is lost, the commit lands late, the retry finds it applied.
        [Deliver(0), Step(0, 3, Fault.UNKNOWN_PENDING), ServerEvent(0), Step(0, 2, CLEAN)],
        "already applied, the server says ok",
        id="late-commit-then-retry",
    ),
    pytest.param(
        one_event(1, commit_retries=1),
        # The commit's reply is lost twice before it applied: ambiguous, deferred. The release
        # waits for the orphaned transaction (the server aborts it); the redelivery completes.
        [Deliver(0), Step(0, 3, Fault.UNKNOWN_PENDING), Step(0, 1, Fault.UNKNOWN_PENDING), Step(0, 1, CLEAN)],
        "c0/h1(e1#m1) concludes deferred COMMIT_AMBIGUOUS",
        id="commit-result-stays-unknown",
    ),
    pytest.param(
        one_event(max_deferrals=1),
        # h2 claims one second before h1's lease expires: held; its first deferral is the bound.
        [Deliver(0), Step(0, 1, CLEAN), Wait(1, beats=False), Deliver(1), Step(1, 2, CLEAN)],
        "c1/h2(e1#m2) settles deferred: dead_lettered QUEUE_DEFERRALS_EXHAUSTED",
        id="live-lease-is-held",
    ),
    pytest.param(
        one_event(1),
        # The consumer crashes right after claiming; the redelivery completes after expiry.
        [Deliver(0), Step(0, 1, CLEAN), Step(0, 1, Fault.CRASH)],
        "c0/h2(e1#m1) settles success: acked",
        id="crashed-owner-completes-after-expiry",
    ),
    pytest.param(
        one_event(1, replay_budget=1, max_deferrals=1),
        # Two transient errors with a budget of one replay: deferred, and at the deferral bound.
        [Deliver(0), Step(0, 2, Fault.TRANSIENT), Step(0, 1, Fault.TRANSIENT), Step(0, 2, CLEAN)],
        "c0/h1(e1#m1) settles deferred: dead_lettered QUEUE_DEFERRALS_EXHAUSTED",
        id="replay-budget-spent",
    ),
    pytest.param(
        one_event(1),
        # A commit that fails without UnknownTransactionCommitResult did not apply: replay (docs/inbox.md, step 5).
        [Deliver(0), Step(0, 2, CLEAN), Step(0, 1, Fault.TRANSIENT)],
        "c0/h1(e1#m1) replays (replay 1 of 1)",
        id="failed-commit-replays",
    ),
    # -- a first-time copy claims inside its transaction ----------------------------------------
    pytest.param(
        one_event(writes=("ledger:e1",), claim_in_transaction=True),
        # Two first-time copies at once: h1's transaction writes the record first; h2's write of
        # it conflicts at once (before its handler ran); h2 replays through the lease claim,
        # which waits for h1's commit and then finds a duplicate.
        [Deliver(0), Deliver(1), Step(0, 1, CLEAN), Step(1, 1, CLEAN), Step(0, 3, CLEAN), Step(1, 2, CLEAN)],
        "c1/h2(e1#m2) settles duplicate",
        id="first-claims-conflict-at-the-write",
    ),
    pytest.param(
        one_event(claim_in_transaction=True),
        # h1's claim in its transaction fails transiently: its replay takes the lease. A first-time
        # copy then finds the lease record (contended), takes the lease claim: held, deferred.
        [Deliver(0), Step(0, 1, Fault.TRANSIENT), Step(0, 1, CLEAN), Deliver(1), Step(1, 2, CLEAN)],
        "c1/h2(e1#m2) concludes deferred LEASE_HELD",
        id="first-claim-finds-a-lease",
    ),
    pytest.param(
        one_event(claim_in_transaction=True),
        [Deliver(0), Step(0, 3, CLEAN), Deliver(1), Step(1, 2, CLEAN)],
        "c1/h2(e1#m2) settles duplicate",
        id="first-claim-finds-the-completion",
    ),
    pytest.param(
        one_event(1, claim_in_transaction=True),
        # The commit applied, its reply was lost: reconciliation recognises this owner's record.
        [Deliver(0), Step(0, 2, Fault.UNKNOWN_APPLIED), Step(0, 2, CLEAN)],
        "c0/h1(e1#m1) reconciles from {state=completed, owner=c0:1, token=1",
        id="first-claim-commit-reply-lost",
    ),
    pytest.param(
        one_event(1, writes=("ledger:e1",), claim_in_transaction=True, max_retries=1),
        # The handler fails: nothing to release (the record was never committed); the retry copy
        # is a new message and claims in its transaction again.
        [Deliver(0), Step(0, 2, Fault.RETRYABLE), Step(0, 1, CLEAN), Deliver(0), Step(0, 4, CLEAN)],
        "c0/h2(e1#m2) settles success: acked",
        id="first-claim-handler-fails-then-retry",
    ),
]


def play(cfg: Config, moves: list[Move]) -> InboxModel:
    """Drive the machine through ``moves``, checking the invariants after each, then drain it."""
    machine = InboxModel()
    machine.start(cfg)
    machine.hold()
    for move in moves:
        machine.act(move)
        machine.hold()
    machine.teardown()
    return machine


@pytest.mark.parametrize(("cfg", "moves", "reaches"), SCENARIOS)
def test_protocol_scenario(cfg: Config, moves: list[Move], reaches: str) -> None:
    machine = play(cfg, moves)
    assert any(reaches in line for line in machine.trace), "\n".join(machine.trace)


# -- the mutation run (not in CI): each mutant of lily_mongo.records must make the model fail ---------


MUTATION_RUN = os.environ.get("LILY_MUTANTS") == "1"


@pytest.mark.skipif(not MUTATION_RUN, reason="the mutation run: set LILY_MUTANTS=1")
@pytest.mark.parametrize("mutant", MUTANTS if MUTATION_RUN else [None], ids=lambda m: m.name if m else "off")
def test_mutant_is_caught(mutant: Mutant, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every non-equivalent mutant of lily_mongo.records fails a scenario or a random run."""
    monkeypatch.setattr(records, mutant.target, mutant.function)
    if mutant.equivalent:
        pytest.skip(f"equivalent under the model: {mutant.why}")
    caught = first_violation(SCENARIO_CASES) or first_violation([run_machine])
    assert caught is not None, f"{mutant.name} survived the scenarios and {EXAMPLES} random runs"
    assert caught.invariant in mutant.caught_by, str(caught)


SCENARIO_CASES = [functools.partial(play, *case.values[:2]) for case in SCENARIOS]


def run_machine() -> None:
    """The random runs, for detection only (no shrinking: the CI test shows minimal counterexamples)."""
    from hypothesis import Phase
    from hypothesis.stateful import run_state_machine_as_test

    detect = settings(MODEL, report_multiple_bugs=False, phases=[Phase.explicit, Phase.generate])
    run_state_machine_as_test(InboxModel, settings=detect)


def first_violation(cases: list[Callable[[], object]]) -> InvariantViolation | None:
    for case in cases:
        try:
            case()
        except InvariantViolation as exc:
            return exc
    return None
