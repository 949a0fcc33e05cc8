"""A protocol model of the inbox (docs/inbox.md) that runs the shipped code, as a hypothesis state machine.

Several consumer processes run :class:`lily_mongo._inbox.Inbox` itself (``execute``: its claim,
attempts, commit loop, reconciliation, releases and counts; its heartbeat) against a simulated
MongoDB replica set with the async client surface the inbox uses (``mongo_sim.py``: snapshot
at the first operation, per-document write conflicts at the write, writers outside a
transaction that wait and time out with ``maxTimeMS``, commits applied with a lost reply,
replication with lag and the rollback of writes past the majority point, the transaction
lifetime's reaper, the read-only commit). Every operation the inbox sends waits at the server
until a rule lets it through, with or without a fault, so hypothesis chooses the interleaving;
the clock is virtual (the event loop's), moved by a rule. Around it: a broker (requeue,
redelivery after a crash, retry and DLQ copies), the runtime's deadline (a cut-off cancels the
delivery's task: ``QUEUE_HANDLER_TIMEOUT``) and its settlement (:func:`lily_mongo._engine.settlement.decide`
with the runtime's deferral rule: the record's count, this process's count as the fallback,
and no count from the broker, as on RabbitMQ 4.3, which no longer counts a ``nack`` with
requeue), crashes, handler failures and republished copies.

Invariants (each failure names one, in brackets):

* ``at-most-once`` -- an event's business writes are committed at most once, all by the one
  transaction that committed its completion, and all of them or none;
* ``majority`` / ``bounded-wait`` -- every write of the records outside a transaction is
  ``w: "majority"`` and carries ``maxTimeMS``, every read there is a majority read, whatever
  the client's default (runs draw ``w: 1`` clients half the time);
* ``fencing`` -- a completion, renewal or release by an owner that is not the record's current
  (owner, token) never changes it;
* ``exclusive-lease`` -- a claim never takes a live lease from its owner and never changes a
  completed record; a claim in a transaction never overwrites a record;
* ``claim-reading`` -- a consumer writes under a lease only if a claim gave it that lease;
* ``ack-proof`` -- an ACK only once the event's completion is majority-committed (a failover
  cannot roll back what it relies on), and a success ACK only after the delivery's own commit;
* ``concurrent-handlers`` -- two handlers of one event never run at once, unless the other's
  transaction was aborted by the server (its lifetime's reaper, a failover, a stepdown), as
  docs/inbox.md says;
* ``waits-are-not-retries`` -- a delivery spends an application retry on a timeout only if
  its handler ran: an infrastructure wait is a deferral;
* ``lifetime`` -- no handler of an event starts after two of its attempts outlived the
  transaction lifetime (docs/inbox.md, "The transaction lifetime"), unless the server could not
  count one of them;
* ``conservation`` -- every copy is queued, in flight, or ended; none is dropped or settled twice;
* ``bounded-requeue`` -- per record, deferred requeues stay within ``max_deferrals - 1`` plus the
  deferrals whose count the consumer could not read back (the delivery's last counting write
  failed, or its answer was lost): a check of what the server answered, not of what the
  consumer believes;
* ``replay`` -- a delivery runs its handler at most ``replay_budget + 1`` times; it defers with
  ``REPLAY_BUDGET_SPENT`` only after that many failed transactions and with ``MONGO_ERROR``
  only after an unlabelled error;
* ``reconciliation`` -- a delivery whose commit applied never runs its handler again and
  settles as a success, or, when neither the commit's reply nor the majority read showed it,
  defers with ``COMMIT_AMBIGUOUS`` (never a handoff, never a duplicate);
* ``liveness`` -- in the teardown, with no more faults and time moving on: every delivery ends,
  orphaned transactions are reaped, copies delivered after every lease expired complete (or are
  duplicates), and every event that was ACKed or still had a copy ends completed.

Besides the random runs, ``SCENARIOS`` walk the same machine through the windows a random run
meets rarely, among them the holes docs/inbox.md closes: a ``w: 1`` claim answering "duplicate"
for a commit a failover then rolls back, a claim waiting behind a transaction, a handler
outliving the transaction lifetime, deferrals counted across a crash.

Not modelled: the outbox, TTL retention, the relay, lost AMQP channels and the cooperation
window of a cut-off handler, and the MongoDB pipelines themselves: the server runs their
Python transitions, so the model is only as true as their equivalence
(``tests/integration/test_record_pipelines.py``).

Budget: ``LILY_MODEL_EXAMPLES`` (default 250) random runs of up to ``LILY_MODEL_STEPS``
(default 30) moves each, plus the teardown's drain; ``LILY_MODEL_EXAMPLES=5000`` is the long
profile. ``LILY_MUTANTS=1`` adds the mutation run (``inbox_mutants.py``): mutants of
``lily_mongo/inbox.py`` (its source, edited) and of :mod:`lily_mongo._inbox.protocol`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import enum
import functools
import inspect
import os
import sys
import types
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
from pymongo.errors import PyMongoError

import lily_mongo._inbox as shipped_inbox
import lily_mongo._inbox.protocol as records
from lily_mongo import QueueHandlerError
from lily_mongo._engine.settlement import Budget, Evidence, HandoffState, SettleState, StepKind, decide
from lily_mongo._errors import ErrorCode
from lily_mongo._inbox.protocol import COMPLETED, LEASED
from lily_mongo._lru import LruCounter
from lily_mongo._mongo.rules import TRANSIENT_LABEL, UNKNOWN_COMMIT_LABEL
from lily_mongo._tasks import TaskSet
from lily_mongo._verdicts import Execution, Outcome, PipelineResult
from tests.property.inbox_mutants import MUTANTS, Mutant, hunt
from tests.property.mongo_sim import ACTOR, EPOCH, Op, Server, SimClient, Txn, TxnState, update_name
from tests.property.mongo_sim import Fault as ServerFault

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
QUEUE = "orders"
DATABASE = "db"
RECORDS = "lily_inbox"
LEDGER = "ledger"
SHARED_DOC = "ledger:all"
DRAIN_GUARD = 4000
MAX_REPUBLISHED = 4  # extra copies per run
MAX_SERVER_ABORTS = 1  # per run (a stepdown): enough to interrupt, few enough to let attempts commit
MAX_FAILOVERS = 1


class NoOutbox:
    """The outbox the model's inbox is given: its handlers write no record, so nothing is dispatched."""

    def writer(self, session: object, handler_id: str, is_open: Callable[[], bool]) -> Any:
        return types.SimpleNamespace(written=0, records=[], claim=None)

    def committed(self, writer: object) -> None:
        raise AssertionError("no model handler writes an outbox record")


class InvariantViolation(AssertionError):
    """A model invariant failed; ``invariant`` names it."""

    def __init__(self, invariant: str, message: str, trace: list[str]) -> None:
        recent = "\n  ".join(trace[-60:])
        super().__init__(f"[{invariant}] {message}\nwhat happened (most recent last):\n  {recent}")
        self.invariant = invariant


# -- the event loop on the model's clock ------------------------------------------------------------


class VirtualLoop:
    """An asyncio event loop whose clock only the model moves: nothing waits in real time.

    ``settle`` runs every ready callback (and what they make ready) until the tasks all wait:
    for an operation the server holds, a handler step, or a timer that is not yet due.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.now = 0.0
        self.loop.time = lambda: self.now  # type: ignore[method-assign]

    def _due(self) -> bool:
        scheduled: list[asyncio.TimerHandle] = self.loop._scheduled  # type: ignore[attr-defined]
        return any(not h.cancelled() and h.when() <= self.now for h in scheduled)

    def settle(self) -> None:
        for _ in range(100_000):
            self.loop.run_until_complete(asyncio.sleep(0))
            if not self.loop._ready and not self._due():  # type: ignore[attr-defined]
                return
        raise AssertionError("the event loop never came to rest")

    def next_timer(self) -> float | None:
        scheduled: list[asyncio.TimerHandle] = self.loop._scheduled  # type: ignore[attr-defined]
        whens = [h.when() for h in scheduled if not h.cancelled()]
        return min(whens) if whens else None

    def close(self) -> None:
        for task in asyncio.all_tasks(self.loop):
            task.cancel()
        self.settle()
        self.loop.close()


# -- what the machine models ---------------------------------------------------------------------


class Fault(enum.Enum):
    """What goes wrong at one step (its meaning depends on the step)."""

    def __repr__(self) -> str:
        return f"Fault.{self.name}"

    NONE = "none"
    TRANSIENT = "transient"  # an operation in a transaction, or a commit: failed, not applied, transient
    ERROR = "error"  # an operation refused without a label, not applied
    LOST = "lost"  # applied, the reply lost (a commit: UnknownTransactionCommitResult)
    PENDING = "pending"  # a commit's reply lost before it applied (it may apply later)
    RETRYABLE = "retryable"  # the handler raises a retryable failure
    PERMANENT = "permanent"  # the handler raises a permanent failure
    CRASH = "crash"  # the consumer process dies instead of taking this step


SERVER_FAULTS = {
    Fault.NONE: ServerFault.NONE,
    Fault.TRANSIENT: ServerFault.TRANSIENT,
    Fault.ERROR: ServerFault.ERROR,
    Fault.LOST: ServerFault.LOST,
    Fault.PENDING: ServerFault.PENDING,
}


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
class Process:
    """One consumer process: its client, its Inbox, its heartbeat, its own deferral counts."""

    index: int
    incarnation: int
    client: SimClient
    inbox: Any
    tasks: TaskSet
    local: LruCounter[str]
    alive: bool = True
    heartbeat: Heartbeat | None = None

    @property
    def name(self) -> str:
        return f"c{self.index}" + (f".{self.incarnation}" if self.incarnation else "")


@dataclass(eq=False)
class Heartbeat:
    process: Process

    @property
    def name(self) -> str:
        return f"hb{self.process.index}"


class Orphans:
    """The sender of operations whose sender stopped waiting (cancelled, or its process died)."""

    name = "orphans"


ORPHANS = Orphans()


@dataclass(eq=False)
class Run:
    """One handler call: the attempt's session (its transaction), when it started and ended."""

    handling: Handling
    session: Any
    started: float
    ended: float | None = None
    cancelled: bool = False

    @property
    def txn(self) -> Txn | None:
        """The attempt's transaction on the server (created by its first operation)."""
        txn: Txn | None = self.session._txn
        return txn


@dataclass(eq=False)
class Gate:
    """A handler step waiting for the model (it may fail there)."""

    handling: Handling
    what: str
    future: asyncio.Future[Fault]


@dataclass(eq=False)
class Handling:
    """One delivery of a message to a process, from ``execute`` to its settlement."""

    hid: int
    process: Process
    msg: Message
    task: asyncio.Task[None] | None = None
    timer: asyncio.TimerHandle | None = None
    cut_off: bool = False
    cut_while_held: bool = False  # cut off while the server held one of its operations (a wait)
    done: bool = False
    runs: list[Run] = field(default_factory=list)
    result: PipelineResult | None = None
    fresh_in_drain: bool = False
    txn_failures: int = 0  # its transactions that did not commit (a replay's reason)
    unlabelled: int = 0  # errors without a label inside its transactions
    unknown_commits: int = 0  # commit answers labelled UnknownTransactionCommitResult
    count_ok: bool = False  # a write of its counted this deferral on the server
    last_count_failed: bool = False  # its last write meant to count a deferral failed

    @property
    def name(self) -> str:
        return f"h{self.hid}"

    @property
    def label(self) -> str:
        return f"{self.process.name}/h{self.hid}({self.msg.event}#m{self.msg.mid})"

    def own_commit(self) -> Txn | None:
        """Its attempt's transaction that committed the completion (and was not rolled back)."""
        for run in self.runs:
            txn = run.txn
            if txn is None or txn.state is not TxnState.COMMITTED or txn.rolled_back:
                continue
            if any(doc is not None and doc.get("state") == COMPLETED for doc in txn.writes.values()):
                return txn
        return None


Actor = Handling | Heartbeat | Orphans
Waiting = Op | Gate


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
    client_w: str = "majority"  # the client's default write concern (its URI's)
    max_wait: float = 1.0
    deadline: float = 20.0
    lifetime: float = 8.0
    replication_faults: bool = True  # the secondary may lag or go down, the primary may fail over
    backoff: float = 0.05  # the replay backoff's first step (scenarios stretch it to open a window)


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
        client_w=draw(st.sampled_from(["majority", "w1"]), label="client_w"),
        max_wait=draw(st.sampled_from([1.0, 2.0]), label="max_wait"),
        deadline=draw(st.sampled_from([20.0, 6.0]), label="deadline"),
        lifetime=draw(st.sampled_from([8.0, 4.0, 30.0]), label="lifetime"),
        replication_faults=draw(st.booleans(), label="replication_faults"),
    )


# -- the moves -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """Let up to ``steps`` waiting steps of one sender through (``pick`` among those that can move);
    ``fault`` strikes the first step it applies to (a crash: instead of the last)."""

    pick: int
    steps: int
    fault: Fault


@dataclass(frozen=True)
class Drive:
    """A scenario's step: like :class:`Step`, for the sender named ``actor`` (``h1``, ``hb0``, ``orphans``)."""

    actor: str
    steps: int = 1
    fault: Fault = Fault.NONE


@dataclass(frozen=True)
class Deliver:
    """The broker delivers the queue's head to a consumer."""

    consumer: int


@dataclass(frozen=True)
class Wait:
    """Time passes: timers fire (heartbeats, backoffs, deadlines), waits run out, the reaper runs."""

    seconds: float


@dataclass(frozen=True)
class Replication:
    """The secondary lags, catches up, goes down or comes back; or the primary fails over."""

    kind: str  # "lag", "catch_up", "down", "up", "failover"


@dataclass(frozen=True)
class ServerEvent:
    """The server aborts an open transaction (a stepdown), or a commit whose reply was lost applies late."""

    pick: int


@dataclass(frozen=True)
class Republish:
    """The publisher sends another copy of an event."""

    pick: int


@dataclass(frozen=True)
class Crash:
    """A scenario's move: consumer ``consumer``'s process dies (and starts again, its memory empty)."""

    consumer: int


Move = Step | Drive | Deliver | Wait | Replication | ServerEvent | Republish | Crash

picks = st.integers(0, 11)
# A third of the steps clean, so the long paths are reached; NONE first so failures shrink to it.
# The commit's two lost replies count double: reconciliation is the deepest path.
faults = st.sampled_from([Fault.NONE] * 5 + [f for f in Fault if f is not Fault.NONE] + [Fault.LOST, Fault.PENDING])
steps = st.builds(Step, pick=picks, steps=st.integers(1, 6), fault=faults)
# Weights by repetition: protocol steps five twelfths of the time, deliveries and waits a sixth each.
delivers = st.builds(Deliver, consumer=st.integers(0, 2))
waits = st.builds(Wait, seconds=st.sampled_from([0.25, 0.5, 0.5, 1.0, 2.0, 4.0]))
moves: st.SearchStrategy[Move] = st.one_of(
    steps,
    delivers,
    steps,
    waits,
    steps,
    st.builds(Replication, kind=st.sampled_from(["lag", "catch_up", "down", "up", "up", "failover"])),
    steps,
    delivers,
    waits,
    steps,
    st.builds(ServerEvent, pick=picks),
    st.builds(Republish, pick=picks),
)


def fenced_for(record: dict[str, Any] | None, owner: str, token: int) -> bool:
    """The fence, stated independently: the record is still leased to this (owner, token)."""
    return (
        record is not None
        and record.get("state") == LEASED
        and record.get("owner") == owner
        and record.get("token") == token
    )


def brief(doc: dict[str, Any] | None) -> str:
    """A record as the trace shows it: its protocol fields, times as t=<seconds>."""
    if doc is None:
        return "absent"
    fields = []
    for name in ("state", "owner", "token", "expires_at", "deferrals", "expirations"):
        value = doc.get(name)
        if isinstance(value, datetime.datetime):
            value = f"t={(value - EPOCH).total_seconds():g}"
        if isinstance(value, str) and name == "owner":
            value = value.split(":")[0] + ":" + value.rsplit(":", 1)[-1]
        if name in doc:
            fields.append(f"{name}={value}")
    return "{" + ", ".join(fields) + "}"


@dataclass(frozen=True)
class SimDelivery:
    """What ``Inbox.execute`` reads of a delivery."""

    envelope: types.SimpleNamespace
    redelivered: bool
    headers: dict[str, Any]


ROUTE = types.SimpleNamespace(handler_id=HANDLER, queue=QUEUE)


class InboxModel(RuleBasedStateMachine):
    """Consumer processes running the shipped inbox, a broker and a MongoDB, one step at a time."""

    INBOX: types.ModuleType = shipped_inbox  # the mutation run swaps in an edited copy
    CHECK_WIRE = True  # the majority and bounded-wait checks (a mutant may turn them off)
    CHECK_ACK_MAJORITY = True  # off: an ACK of a completion not yet majority-committed is let through

    def __init__(self) -> None:
        super().__init__()
        self.vloop = VirtualLoop()
        self.cfg: Config | None = None
        self.server = Server(lambda: self.vloop.now, lifetime=8.0)
        self.processes: list[Process] = []
        self.queue: list[Message] = []
        self.messages: list[Message] = []
        self.handlings: list[Handling] = []
        self.gates: list[Gate] = []
        self.trace: list[str] = []
        self.specs: dict[str, EventSpec] = {}
        self.completer: dict[str, Txn] = {}  # event -> the transaction whose commit completed it
        self.incarnation: Counter[str] = Counter()  # per event: how often its record was deleted
        self.requeued: Counter[tuple[str, int]] = Counter()
        self.excused: Counter[tuple[str, int]] = Counter()
        self.landings: list[tuple[int, Handling, str, int]] = []  # (optime, delivery, event, incarnation)
        self.offered: set[tuple[str, int]] = set()  # (owner, token) of every lease a claim gave
        self.outlived: Counter[tuple[str, int]] = Counter()
        self.uncounted_expiries: Counter[tuple[str, int]] = Counter()  # expiry counts the server refused
        self.acked: set[str] = set()
        self.next_reap = 0.0
        self.aborts = 0
        self.republished = 0
        self.draining = False
        self.pending_violation: InvariantViolation | None = None

    # -- helpers ---------------------------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.vloop.now

    def log(self, line: str) -> None:
        self.trace.append(f"t={self.now:g} {line}")

    def reached(self, situation: str) -> None:
        """Count a situation the model reached (pytest --hypothesis-show-statistics)."""
        if not self.draining and currently_in_test_context():
            count_event(situation)

    def expect(self, ok: object, invariant_: str, message: str) -> None:
        if not ok:
            violation = InvariantViolation(invariant_, message, self.trace)
            if self.pending_violation is None:
                self.pending_violation = violation
            raise violation

    def raise_pending(self) -> None:
        """A violation found inside a task (the inbox's code swallowed nothing: the task stopped)."""
        if self.pending_violation is not None:
            raise self.pending_violation

    def config(self) -> Config:
        assert self.cfg is not None
        return self.cfg

    def key_of(self, event: str) -> str:
        return records.record_key(HANDLER, event)

    def event_of(self, key: str) -> str | None:
        return key.split("|", 1)[1] if key.startswith(f"{HANDLER}|") else None

    def live(self) -> list[Handling]:
        return [h for h in self.handlings if not h.done]

    def settle_loop(self) -> None:
        self.vloop.settle()
        for h in self.handlings:
            task = h.task
            if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
                exc = task.exception()
                self.raise_pending()
                h.task = None
                if h.process.alive:
                    raise AssertionError(f"{h.label}: the delivery task failed") from exc
        self.raise_pending()

    # -- set-up ---------------------------------------------------------------------------------

    @initialize(cfg=configs())
    def start(self, cfg: Config) -> None:
        self.cfg = cfg
        self.server = Server(lambda: self.vloop.now, lifetime=cfg.lifetime)
        self.server.trace = self.log
        self.server.on_write = self.on_write
        self.server.on_commit = self.on_commit
        self.server.on_rollback = self.on_rollback
        self.server.on_answer = self.on_answer
        self.next_reap = cfg.lifetime / 2
        for spec in cfg.events:
            self.specs[spec.name] = spec
            for _ in range(spec.copies):
                self.publish(spec.name, retry_count=0)
        for index in range(cfg.consumers):
            self.processes.append(self.boot(index, 0))
        self.log(f"published {len(self.messages)} copies; {cfg}")

    def options(self) -> Any:
        cfg = self.config()
        known = {f.name for f in dataclasses.fields(self.INBOX.InboxOptions)}  # an older inbox.py has fewer
        options = dict(
            records=RECORDS,
            lease_seconds=cfg.lease_seconds,
            stale_lease_seconds=60,
            retention_seconds=3600,
            replay_budget=cfg.replay_budget,
            commit_retries=cfg.commit_retries,
            backoff_base=cfg.backoff,
            backoff_max=max(cfg.backoff * 4, 0.2),
            claim_in_transaction=cfg.claim_in_transaction,
            max_wait_seconds=cfg.max_wait,
            run_relay=False,
        )
        return self.INBOX.InboxOptions(**{name: value for name, value in options.items() if name in known})

    def boot(self, index: int, incarnation: int) -> Process:
        cfg = self.config()
        client = SimClient(self.server, w=cfg.client_w)
        extra: dict[str, Any] = {"deadlines": {QUEUE: cfg.deadline}}
        parameters = inspect.signature(self.INBOX.Inbox).parameters
        if "deadlines" not in parameters:  # an older inbox.py
            extra = {}
        if "outbox" in parameters:  # the model's handlers write no outbox record
            extra["outbox"] = NoOutbox()
        inbox = self.INBOX.Inbox(client, DATABASE, self.options(), owner_prefix=f"c{index}.{incarnation}", **extra)
        process = Process(index, incarnation, client, inbox, TaskSet(), LruCounter(4096))
        heartbeat = process.heartbeat = Heartbeat(process)

        async def boot() -> None:
            ACTOR.set(heartbeat)
            await inbox.prepare()
            inbox.start(process.tasks)

        self.vloop.loop.run_until_complete(boot())
        self.settle_loop()
        return process

    # -- rules ------------------------------------------------------------------------------------

    # One rule, whose argument says what happens next. (Several rules would let hypothesis's
    # swarm testing switch the protocol steps off for a whole run, a third of the runs.)
    @rule(move=moves)
    def act(self, move: Move) -> None:
        match move:
            case Step():
                actors = self.ready_actors(replies=move.fault is Fault.LOST)
                if actors:
                    self.drive(actors[move.pick % len(actors)], move.steps, move.fault)
            case Drive(actor=name, steps=n, fault=fault):
                actor = self.actor_named(name, replies=fault is Fault.LOST)
                if actor is None:  # the scenario's test notices when it does not reach its end
                    self.log(f"(nothing of {name} can move now)")
                else:
                    self.drive(actor, n, fault)
            case Deliver(consumer=consumer):
                process = self.processes[consumer % self.config().consumers]
                if self.queue:
                    self.deliver(process)
            case Wait(seconds=seconds):
                self.wait(seconds)
            case Replication(kind=kind):
                self.replication(kind)
            case ServerEvent(pick=pick):
                self.server_event(pick)
            case Republish(pick=pick):
                self.republish(pick)
            case Crash(consumer=consumer):
                self.crash(self.processes[consumer % self.config().consumers])
        self.settle_loop()

    def publish(self, event: str, *, retry_count: int) -> Message:
        msg = Message(mid=len(self.messages) + 1, event=event, retry_count=retry_count)
        self.messages.append(msg)
        self.queue.append(msg)
        return msg

    def republish(self, pick: int) -> None:
        if self.republished >= MAX_REPUBLISHED:
            return
        event = self.config().events[pick % len(self.config().events)].name
        self.republished += 1
        msg = self.publish(event, retry_count=0)
        self.log(f"another copy of {event} is published (m{msg.mid})")

    # -- who can move -------------------------------------------------------------------------------

    def sender(self, op: Op) -> Actor:
        actor = op.actor
        if op.orphan or not isinstance(actor, Handling | Heartbeat) or not actor.process.alive:
            return ORPHANS
        if isinstance(actor, Handling) and actor.done:
            return ORPHANS
        return actor

    def waiting(self, actor: Actor, *, replies: bool = False) -> list[Waiting]:
        """What ``actor`` waits for that the model can let through now, oldest first; with
        ``replies``, also the acknowledgements waiting for the majority (a fault can lose them)."""
        ops: list[Waiting] = [
            o
            for o in self.server.ops
            if self.sender(o) is actor and (self.server.ready(o) or (replies and o.awaiting is not None))
        ]
        gates: list[Waiting] = [g for g in self.gates if g.handling is actor]
        return ops + gates

    def ready_actors(self, *, replies: bool = False) -> list[Actor]:
        heartbeats = [p.heartbeat for p in self.processes if p.heartbeat is not None]
        candidates: list[Actor] = [*self.live(), *heartbeats, ORPHANS]
        return [actor for actor in candidates if self.waiting(actor, replies=replies)]

    def actor_named(self, name: str, *, replies: bool = False) -> Actor | None:
        return next((a for a in self.ready_actors(replies=replies) if a.name == name), None)

    def drive(self, actor: Actor, steps: int, fault: Fault) -> None:
        for n in range(steps, 0, -1):
            waiting = self.waiting(actor, replies=fault is Fault.LOST)
            if not waiting:
                return
            if fault is Fault.CRASH and n == 1 and not isinstance(actor, Orphans):
                process = actor.process
                self.reached("consumer crash")
                self.crash(process)
                return
            item = waiting[0]
            strike = fault if self.applies(fault, item) else Fault.NONE
            self.let_through(item, strike)
            if strike is not Fault.NONE:
                return

    def applies(self, fault: Fault, item: Waiting) -> bool:
        if isinstance(item, Gate):
            return fault in (Fault.RETRYABLE, Fault.PERMANENT)
        if item.awaiting is not None:
            return fault is Fault.LOST
        if item.kind == "commit":
            return fault in (Fault.TRANSIENT, Fault.ERROR, Fault.LOST, Fault.PENDING)
        if item.txn is not None:
            return fault in (Fault.TRANSIENT, Fault.ERROR)
        if item.kind == "find_one":
            return fault is Fault.ERROR
        return fault in (Fault.ERROR, Fault.LOST)

    def let_through(self, item: Waiting, fault: Fault) -> None:
        if isinstance(item, Gate):
            self.gates.remove(item)
            self.log(
                f"{item.handling.label} handler {item.what}"
                + (f": raises {fault.value}" if fault.value != "none" else "")
            )
            if not item.future.done():
                item.future.set_result(fault)
            self.settle_loop()
            return
        self.check_wire(item)
        who = self.sender(item)
        what = item.describe()
        outcome = self.server.resolve(item, SERVER_FAULTS[fault])
        label = who.label if isinstance(who, Handling) else who.name
        self.log(f"{label} {what}{f' [{fault.value}]' if fault is not Fault.NONE else ''}: {outcome}")
        self.reached(f"{update_name(item.update) if item.update is not None else item.kind}: {outcome.split(';')[0]}")
        self.settle_loop()

    def check_wire(self, op: Op) -> None:
        """What the integration test reads on the wire: majority and maxTimeMS outside transactions."""
        if not self.CHECK_WIRE or op.collection != RECORDS or op.txn is not None:
            return
        what = op.describe()
        if op.kind == "find_one":
            self.expect(op.majority, "majority", f"{what} read without majority read concern")
            return
        self.expect(op.majority, "majority", f"{what} was sent without w: majority (the client says {op.client.w})")
        self.expect(op.deadline is not None, "bounded-wait", f"{what} was sent without maxTimeMS")

    # -- time, replication, the server's own moves ---------------------------------------------------

    def next_event(self) -> float | None:
        times = [t for t in (self.vloop.next_timer(), self.next_reap) if t is not None]
        times += [o.deadline for o in self.server.ops if o.deadline is not None]
        later = [t for t in times if t > self.now]
        return min(later) if later else None

    def wait(self, seconds: float) -> None:
        target = self.now + seconds
        self.log(f"{seconds:g}s pass")
        while True:
            upcoming = self.next_event()
            if upcoming is None or upcoming > target:
                break
            self.tick(upcoming)
        self.tick(target)

    def tick(self, when: float) -> None:
        self.vloop.now = max(self.vloop.now, when)
        self.server.expire()
        while self.next_reap <= self.now:
            self.next_reap += self.config().lifetime / 2
            if self.server.reap():
                self.reached("the reaper aborts a transaction")
        self.settle_loop()

    def replication(self, kind: str) -> None:
        server = self.server
        if not self.config().replication_faults:
            return
        if kind == "failover":
            if server.failovers >= MAX_FAILOVERS:
                return
            lost = server.failover()
            self.reached("failover")
            self.log(f"failover: the secondary takes over at optime {server.majority}; {len(lost)} writes rolled back")
        elif kind == "catch_up":
            server.replicate()
            self.log("the secondary catches up")
        else:
            server.set_secondary({"lag": "lagging", "down": "down", "up": "up"}[kind])
            self.log(f"the secondary is {server.secondary}")
        server.release_waiters()

    def server_event(self, pick: int) -> None:
        txns = self.server.open_txns()
        options = [("late_commit", t) for t in txns if t.in_flight]
        if self.aborts < MAX_SERVER_ABORTS and self.config().replication_faults:
            options += [("abort", t) for t in txns]
        if not options:
            return
        kind, txn = options[pick % len(options)]
        self.reached(f"server: {kind}")
        if kind == "abort":
            self.aborts += 1
            self.server.abort(txn, "server")
            self.log(f"the server aborts txn {txn.tid} (a stepdown)")
        else:
            self.server.apply_commit(txn)
            self.log(f"the delayed commit of txn {txn.tid} arrives and applies")

    # -- the server's hooks: what it did, checked as it happens -------------------------------------

    def on_write(self, op: Op, key: str, before: dict[str, Any] | None, after: dict[str, Any] | None) -> None:
        event = self.event_of(key)
        if event is None:
            return
        name = update_name(op.update) if op.update is not None else op.kind
        fence = op.filter if "owner" in op.filter else None
        if fence is not None:
            owner, token = fence["owner"], fence["token"]
            self.expect(
                (owner, token) in self.offered,
                "claim-reading",
                f"{op.describe()} under the lease ({owner}, {token}), which no claim gave",
            )
            if not fenced_for(before, owner, token):
                self.reached(f"{name} by a stale owner")
                self.log(f"{op.describe()} by a stale owner ({owner.split(':')[0]}, token {token}): {brief(before)}")
                self.expect(
                    after == before,
                    "fencing",
                    f"{op.describe()} by a stale owner changed {brief(before)} to {brief(after)}",
                )
        if name == "claim":
            self.check_claim(op, before, after)
        if name == "first-claim":
            self.expect(
                before is None or after == before,
                "exclusive-lease",
                f"the claim in txn {op.txn.tid if op.txn else '-'} overwrote {brief(before)} with {brief(after)}",
            )
        if op.txn is None:
            if before is not None and after is None:
                if isinstance(op.actor, Handling) and op.actor.cut_off:
                    self.expect(
                        records.counts_nothing(before),
                        "bounded-requeue",
                        f"{op.actor.label}, cut off by its deadline, deleted {brief(before)}: its counts are lost "
                        "although the same event comes back",
                    )
                self.incarnation[event] += 1
            counted = records.read_count(after, records.DEFERRALS) > records.read_count(before, records.DEFERRALS)
            actor = op.actor
            if isinstance(actor, Handling) and name in ("claim", "deferral-release", "count") and counted:
                self.landings.append((self.server.optime, actor, event, self.incarnation[event]))
                actor.count_ok, actor.last_count_failed = True, False

    def check_claim(self, op: Op, before: dict[str, Any] | None, after: dict[str, Any] | None) -> None:
        """The claim as docs/inbox.md (step 1) states it: completed stays completed, a live lease stays its
        owner's, and anything else (absent, released, expired on the server clock) is leased to the claimant."""
        assert after is not None
        owner = after.get("owner")
        if before is not None and before.get("state") == COMPLETED:
            self.expect(after == before, "exclusive-lease", f"a claim changed a completed record to {brief(after)}")
            return
        expires = None if before is None or before.get("owner") is None else before.get("expires_at")
        claimant = op.update[1]["$set"]["owner"]["$cond"][1]
        if expires is None or expires <= self.server.now:
            self.expect(
                after.get("state") == LEASED and owner == claimant,
                "liveness",
                f"a claim at t={self.now:g} left the free lease {brief(before)}: {brief(after)}",
            )
            self.offered.add((claimant, int(after["token"])))
            return
        assert before is not None
        kept = after.get("owner") == before.get("owner") and after.get("token") == before.get("token")
        self.expect(
            kept, "exclusive-lease", f"a claim at t={self.now:g} took the live lease {brief(before)}: {brief(after)}"
        )

    def on_answer(self, op: Op, error: BaseException | None) -> None:
        """Every answer the server gives: what a delivery's transactions and counts met."""
        actor = op.actor
        if not isinstance(actor, Handling):
            return
        name = update_name(op.update) if op.update is not None else op.kind
        counts = name == "deferral-release" or (name == "count" and records.DEFERRALS in op.update[0]["$set"])
        if op.txn is None and counts and error is not None:
            actor.last_count_failed = True
        if op.txn is None and name == "count" and records.EXPIRATIONS in op.update[0]["$set"] and error is not None:
            event = actor.msg.event
            self.uncounted_expiries[(event, self.incarnation[event])] += 1
        if error is None or (op.txn is None and op.kind != "commit"):
            return
        labels = {
            label
            for label in (TRANSIENT_LABEL, UNKNOWN_COMMIT_LABEL)
            if isinstance(error, PyMongoError) and error.has_error_label(label)
        }
        if name == "first-claim" and TRANSIENT_LABEL in labels:
            return  # contended: no handler ran, the lease claim follows
        if UNKNOWN_COMMIT_LABEL in labels:
            actor.unknown_commits += 1
            return
        if TRANSIENT_LABEL in labels or op.kind == "commit":
            actor.txn_failures += 1
        else:
            actor.unlabelled += 1

    def on_commit(self, txn: Txn) -> None:
        for key, doc in txn.writes.items():
            event = self.event_of(key)
            if event is not None and doc is not None and doc.get("state") == COMPLETED:
                earlier = self.completer.get(event)
                self.expect(
                    earlier is None or earlier.rolled_back,
                    "at-most-once",
                    f"{event} completed a second time by txn {txn.tid} "
                    f"(first by txn {earlier.tid if earlier else '-'})",
                )
                self.completer[event] = txn

    def on_rollback(self, lost: list[tuple[str, int, dict[str, Any] | None, dict[str, Any] | None]]) -> None:
        cut = self.server.majority
        for event, txn in list(self.completer.items()):
            if txn.rolled_back:
                del self.completer[event]
                self.log(f"the completion of {event} by txn {txn.tid} is rolled back")
        kept = []
        for landing in self.landings:
            if landing[0] > cut:
                landing[1].count_ok = False
                landing[1].last_count_failed = True
            else:
                kept.append(landing)
        self.landings = kept
        for key, optime, before, doc in lost:
            self.log(f"rolled back: {key} at optime {optime} ({brief(doc)}), back to {brief(before)}")

    # -- the broker and the deliveries ----------------------------------------------------------------

    def deliver(self, process: Process, *, fresh_in_drain: bool = False) -> Handling:
        msg = self.queue.pop(0)
        msg.state = MsgState.IN_FLIGHT
        msg.deliveries += 1
        h = Handling(len(self.handlings) + 1, process, msg, fresh_in_drain=fresh_in_drain)
        self.handlings.append(h)
        self.log(f"{h.label} delivered (delivery {msg.deliveries} of m{msg.mid}, x-retry-count {msg.retry_count})")
        h.task = self.vloop.loop.create_task(self.run_delivery(h))
        h.timer = self.vloop.loop.call_at(self.now + self.config().deadline, self.cut_off, h)
        self.settle_loop()
        return h

    def cut_off(self, h: Handling) -> None:
        """The runtime's delivery deadline: the delivery's task is cancelled."""
        if h.done or h.task is None or h.task.done():
            return
        h.cut_off = True
        h.cut_while_held = any(
            o.actor is h and (self.server.blocked(o) or o.awaiting is not None) for o in self.server.ops
        )
        self.log(f"{h.label} passes its deadline: its task is cancelled")
        self.reached("deadline cuts a delivery off")
        h.task.cancel()

    async def run_delivery(self, h: Handling) -> None:
        ACTOR.set(h)
        msg = h.msg
        delivery = SimDelivery(types.SimpleNamespace(event_id=msg.event), msg.deliveries > 1, {})
        inbox = h.process.inbox
        try:
            execution = await inbox.execute(ROUTE, delivery, None, functools.partial(self.invoke, h))
        except asyncio.CancelledError:
            if not h.cut_off or not h.process.alive:
                return
            reason = f"handler exceeded the delivery deadline of {self.config().deadline:g} s"
            execution = Execution(PipelineResult(Outcome.RETRYABLE, ErrorCode.HANDLER_TIMEOUT, reason), attempts=1)
        except PyMongoError:
            if not h.process.alive:
                return
            raise
        finally:
            if h.timer is not None:
                h.timer.cancel()
        if h.process.alive:
            self.settle(h, execution)

    async def gate(self, h: Handling, what: str) -> None:
        future: asyncio.Future[Fault] = asyncio.get_running_loop().create_future()
        gate = Gate(h, what, future)
        self.gates.append(gate)
        try:
            fault = await future
        finally:
            if gate in self.gates:
                self.gates.remove(gate)
        if fault is Fault.RETRYABLE:
            raise QueueHandlerError.retryable("PAYMENT_DOWN", "gateway 503")
        if fault is Fault.PERMANENT:
            raise QueueHandlerError.permanent("ORDER_INVALID", "no lines")

    async def invoke(self, h: Handling, attempt: int, scope: Any, payload: Any) -> PipelineResult:
        """The handler (as ``dispatch.invoke`` calls it): a step, then each write after a step."""
        spec = self.specs[h.msg.event]
        run = Run(h, scope.session, self.now)
        self.handler_starts(run)
        try:
            for index, doc in enumerate(spec.writes):
                await self.gate(h, f"step before write {index}")
                await scope.database[LEDGER].update_one(
                    {"_id": doc}, {"$push": {"entries": [h.msg.event, index]}}, upsert=True, session=scope.session
                )
            await self.gate(h, "returns")
        except QueueHandlerError as exc:
            return PipelineResult(Outcome.RETRYABLE if exc.is_retryable else Outcome.PERMANENT, exc.code, exc.message)
        except asyncio.CancelledError:
            run.cancelled = True
            raise
        except PyMongoError as exc:
            if self.INBOX.Inbox.passthrough(exc):
                raise
            return PipelineResult(Outcome.RETRYABLE, ErrorCode.HANDLER_FAILED, f"{type(exc).__name__}: {exc}")
        finally:
            self.handler_ends(run)
        return PipelineResult(Outcome.SUCCESS)

    def running(self, event: str) -> list[Run]:
        return [r for h in self.handlings for r in h.runs if r.ended is None and h.msg.event == event]

    def handler_starts(self, run: Run) -> None:
        h = run.handling
        event = h.msg.event
        cfg = self.config()
        slot = (event, self.incarnation[event])
        self.log(f"{h.label} handler starts (run {len(h.runs) + 1}, txn {run.txn.tid if run.txn else '-'})")
        try:
            for other in self.running(event):
                txn = other.txn
                aborted = (
                    txn is not None
                    and txn.state is TxnState.ABORTED
                    and txn.aborted_by in ("reaper", "failover", "server")
                )
                self.expect(
                    aborted,
                    "concurrent-handlers",
                    f"{h.label}'s handler starts while {other.handling.label}'s runs, its transaction "
                    f"{'not aborted by the server' if txn is not None else 'absent'}",
                )
                self.reached("a handler starts while one whose transaction the server aborted still runs")
                self.log(
                    f"{h.label}'s handler starts while {other.handling.label}'s, whose transaction the server "
                    f"aborted ({txn.aborted_by if txn else '-'}), still runs"
                )
            self.expect(
                self.outlived[slot] < 2 + self.uncounted_expiries[slot],
                "lifetime",
                f"{h.label}'s handler starts after {self.outlived[slot]} attempts of {event} outlived the lifetime "
                f"({self.uncounted_expiries[slot]} of them the server could not count)",
            )
            self.expect(
                len(h.runs) < cfg.replay_budget + 1,
                "replay",
                f"{h.label} starts its handler a {len(h.runs) + 1}th time with a replay budget of {cfg.replay_budget}",
            )
            self.expect(
                h.own_commit() is None,
                "reconciliation",
                f"{h.label} runs its handler again after its own commit applied (docs/inbox.md, step 6)",
            )
        finally:
            h.runs.append(run)

    def handler_ends(self, run: Run) -> None:
        run.ended = self.now
        txn = run.txn
        if txn is None:
            return
        h = run.handling
        old = txn.started is not None and self.now - txn.started >= self.config().lifetime
        if txn.aborted_by == "reaper" or (run.cancelled and old and txn.state is not TxnState.COMMITTED):
            self.outlived[(h.msg.event, self.incarnation[h.msg.event])] += 1
            self.reached("a handler outlived the transaction lifetime")

    def requeue(self, msg: Message) -> None:
        msg.state = MsgState.QUEUED
        self.queue.append(msg)

    def crash(self, process: Process) -> None:
        process.alive = False
        process.client.dead = True
        for h in self.live():
            if h.process is process:
                h.done = True
                self.requeue(h.msg)  # unacked: the broker redelivers it
                if h.task is not None:
                    h.task.cancel()
        for task in process.tasks.pending():
            task.cancel()
        self.gates = [g for g in self.gates if g.handling.process is not process]
        self.log(f"consumer {process.name} crashes; its unacked deliveries return to the queue")
        self.settle_loop()
        self.processes[process.index] = self.boot(process.index, process.incarnation + 1)

    # -- settlement (the runtime's rule, then settlement.decide) ------------------------------------------

    def settle(self, h: Handling, execution: Execution) -> None:
        cfg = self.config()
        result, msg = execution.result, h.msg
        h.result = result
        self.log(f"{h.label} concludes {result.outcome.value} {result.code or ''}".rstrip())
        self.check_conclusion(h, result)
        deferrals = execution.deferrals
        if result.outcome is Outcome.DEFERRED:
            # The runtime's rule (runtime._settle): the record's count, or this process's own;
            # no x-delivery-count (RabbitMQ 4.3 counts no nack with requeue).
            deferrals = max(deferrals, h.process.local.bump(msg.event))
        budget = Budget(
            retry_count=msg.retry_count,
            max_retries=cfg.max_retries,
            deferrals=deferrals,
            max_deferrals=cfg.max_deferrals,
        )
        evidence = Evidence()
        retry_copy: int | None = None
        for _ in range(6):
            step = decide(result, budget, evidence)
            if step.kind in (StepKind.DONE, StepKind.UNRESOLVED):
                break
            if step.kind in (StepKind.PUBLISH_RETRY, StepKind.PUBLISH_DLQ):
                if step.kind is StepKind.PUBLISH_RETRY:
                    retry_copy = step.retry_count
                evidence = dataclasses.replace(evidence, handoff=HandoffState.CONFIRMED)
                continue
            if step.kind is StepKind.ACK and evidence.handoff is HandoffState.NONE:
                self.check_ack(h, result)
            evidence = dataclasses.replace(evidence, settle=SettleState.SENT, settled_with=step.kind)
        else:  # pragma: no cover - decide() ends within four steps (test_settlement_props)
            raise AssertionError("settlement did not end")
        terminal = step.terminal.value if step.terminal else "?"
        h.done = True
        self.log(f"{h.label} settles {result.outcome.value}: {terminal} {step.code or ''}".rstrip())
        self.reached(f"settled: {terminal} {step.code or ''}".rstrip())
        if h.fresh_in_drain:
            self.expect(
                terminal in ("acked", "duplicate") or step.code == ErrorCode.TRANSACTION_EXPIRED,
                "liveness",
                f"{h.label} was delivered after every lease expired, with no open transaction and no faults, "
                f"yet ended {terminal} ({result.code})",
            )
        if terminal == "deferred":
            self.requeue(msg)
            landed = [incarnation for _, d, _, incarnation in self.landings if d is h]
            slot = (msg.event, landed[-1]) if landed else (msg.event, self.incarnation[msg.event])
            self.requeued[slot] += 1
            self.excused[slot] += h.last_count_failed
            return
        msg.state, msg.terminal = MsgState.ENDED, terminal
        if terminal in ("acked", "duplicate"):
            self.acked.add(msg.event)
        elif terminal == "retried":
            assert retry_copy is not None
            self.publish(msg.event, retry_count=retry_copy)
        else:
            self.expect(terminal == "dead_lettered", "conservation", f"{h.label} ended {terminal}")

    def check_conclusion(self, h: Handling, result: PipelineResult) -> None:
        """What an attempt's verdict must agree with: its own commit, and the errors it met."""
        cfg = self.config()
        own = h.own_commit()
        if own is not None and not h.cut_off:
            # Its commit applied: a success, or (the reply and the majority read both failed
            # to show it) an ambiguous deferral; the next delivery's claim finds it completed.
            self.expect(
                result.outcome is Outcome.SUCCESS or result.code == ErrorCode.COMMIT_AMBIGUOUS,
                "reconciliation",
                f"{h.label}'s own commit (txn {own.tid}) applied, yet it concluded "
                f"{result.outcome.value} ({result.code})",
            )
        if result.code == ErrorCode.HANDLER_TIMEOUT:
            self.expect(
                h.runs or not h.cut_while_held,
                "waits-are-not-retries",
                f"{h.label} spends an application retry on a timeout: its handler never ran, the server held "
                "its operation (a wait behind a transaction or for the majority) until the deadline",
            )
        if result.code == ErrorCode.COMMIT_AMBIGUOUS:
            self.expect(
                h.unknown_commits,
                "replay",
                f"{h.label} deferred COMMIT_AMBIGUOUS although no commit of its answered an unknown result",
            )
        if result.code == ErrorCode.MONGO_ERROR:
            self.expect(h.unlabelled, "replay", f"{h.label} deferred MONGO_ERROR after labelled errors only")
        if result.code == ErrorCode.REPLAY_BUDGET_SPENT:
            self.expect(
                h.txn_failures >= cfg.replay_budget + 1,
                "replay",
                f"{h.label} spent its replay budget ({cfg.replay_budget}) after {h.txn_failures} failed transactions",
            )

    def check_ack(self, h: Handling, result: PipelineResult) -> None:
        key = self.key_of(h.msg.event)
        record = self.server.majority_doc(key)
        if result.outcome is Outcome.SUCCESS:
            self.expect(
                h.own_commit() is not None, "ack-proof", f"{h.label} ACKs a success without its own commit applied"
            )
        if not self.CHECK_ACK_MAJORITY:  # to see what such an ACK leads to: the drain's liveness check
            record = self.server.doc(key)
        self.expect(
            result.outcome in (Outcome.SUCCESS, Outcome.DUPLICATE)
            and record is not None
            and record.get("state") == COMPLETED,
            "ack-proof",
            f"{h.label} ACKs {result.outcome.value} while the majority-committed record is {brief(record)} "
            f"(on the primary: {brief(self.server.doc(key))}): a failover can roll the completion back",
        )

    # -- invariants -------------------------------------------------------------------------------------

    @invariant()
    def hold(self) -> None:
        self.raise_pending()
        self.effects_at_most_once()
        self.every_copy_accounted_for()
        self.requeues_bounded()

    def effects_at_most_once(self) -> None:
        if self.cfg is None:
            return
        entries: dict[str, list[tuple[int, int]]] = {}
        for key, doc in self.server.docs():
            if key.startswith("ledger:"):
                for event, index, tid in doc["entries"]:
                    entries.setdefault(event, []).append((index, tid))
        for event, spec in self.specs.items():
            found = sorted(entries.get(event, []))
            record = self.server.doc(self.key_of(event))
            completed = record is not None and record.get("state") == COMPLETED
            txn = self.completer.get(event)
            if found or completed:
                expected = sorted((i, txn.tid) for i in range(len(spec.writes))) if txn is not None else []
                self.expect(
                    completed and found == expected,
                    "at-most-once",
                    f"{event}: committed effects (write, txn) {found}, expected {expected} from the completing txn "
                    f"{txn.tid if txn else None}; record {brief(record)}",
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
        for slot, n in self.requeued.items():
            extra = self.excused[slot]
            self.expect(
                n <= bound + extra,
                "bounded-requeue",
                f"{slot[0]} (record incarnation {slot[1]}) was requeued {n} times as deferred; max_deferrals "
                f"{self.cfg.max_deferrals} allows {bound}, plus {extra} whose count the server could not take",
            )

    # -- liveness ------------------------------------------------------------------------------------

    def teardown(self) -> None:
        if self.vloop.loop.is_closed():
            return
        try:
            if self.cfg is not None and sys.exc_info()[0] is None and self.pending_violation is None:
                self.drain()
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Stop every process and close the event loop (no drain)."""
        if self.vloop.loop.is_closed():
            return
        for process in self.processes:
            process.client.dead = True
            process.alive = False
        self.vloop.close()

    def drain(self) -> None:
        """No more faults; the secondary is up; time moves on until every copy has ended."""
        self.draining = True
        self.log("-- drain: no more faults; the secondary is up")
        self.server.set_secondary("up")
        for _ in range(DRAIN_GUARD):
            ready = [w for a in self.ready_actors() for w in self.waiting(a)]
            if ready:
                ready.sort(key=lambda w: 0 if isinstance(w, Op) and w.kind == "commit" else 1)
                self.let_through(ready[0], Fault.NONE)
                continue
            if self.live() or self.server.ops or self.server.open_txns():
                upcoming = self.next_event()
                self.expect(upcoming is not None, "liveness", f"stuck: {[h.label for h in self.live()]}")
                assert upcoming is not None
                self.tick(upcoming)
                continue
            if not self.queue:
                break
            expiries = [
                d["expires_at"] for _, d in self.server.docs() if isinstance(d.get("expires_at"), datetime.datetime)
            ]
            latest = max([self.server.now, *expiries])
            self.tick((latest - EPOCH).total_seconds() + 1)
            process = next(p for p in self.processes if p.alive)
            self.deliver(process, fresh_in_drain=True)
        else:
            self.expect(False, "liveness", f"the drain did not end within {DRAIN_GUARD} steps")
        for msg in self.messages:
            self.expect(msg.state is MsgState.ENDED, "liveness", f"m{msg.mid} did not end: {msg.state.value}")
        fresh = {h.msg.event for h in self.handlings if h.fresh_in_drain}
        for event in self.specs:
            if event in fresh or event in self.acked:
                record = self.server.majority_doc(self.key_of(event))
                expired = any(
                    h.result is not None and h.result.code == ErrorCode.TRANSACTION_EXPIRED
                    for h in self.handlings
                    if h.msg.event == event
                )
                self.expect(
                    (record is not None and record.get("state") == COMPLETED) or (expired and event not in self.acked),
                    "liveness",
                    f"{event} was ACKed or still had copies, yet ends {brief(record)}: the event is lost",
                )
        self.hold()


InboxModel.TestCase.settings = MODEL
# The default per-test timeout (120 s) fits the CI budget; the long profile gets more.
test_inbox_protocol_model = pytest.mark.timeout(max(120, EXAMPLES // 5))(InboxModel.TestCase)


# -- scenarios: the narrow windows, walked through on the same machine ------------------------------


def one_event(copies: int = 2, *, writes: tuple[str, ...] = (), **options: Any) -> Config:
    """One event; first-time copies take the lease claim unless ``claim_in_transaction=True``."""
    base: dict[str, Any] = {
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


def play(cfg: Config, moves: list[Move], *, machine_class: type[InboxModel] = InboxModel) -> InboxModel:
    """Drive the machine through ``moves``, checking the invariants after each, then drain it."""
    machine = machine_class()
    try:
        machine.start(cfg)
        machine.hold()
        for move in moves:
            machine.act(move)
            machine.hold()
    except BaseException:
        machine.abandon()
        raise
    machine.teardown()
    return machine


# h1 claims (t=0, lease until t=2), its completion fails transiently, and it backs off for 3 s
# or more; its renewals go unanswered; at t=2.1 h2 takes the expired lease over.
STALLED_THEN_TAKEN_OVER: list[Move] = [
    Deliver(0),
    Drive("h1", 2, Fault.TRANSIENT),
    Wait(2.1),
    Deliver(1),
    Drive("h2", 1),
]

SCENARIOS = [
    # -- the holes docs/inbox.md closes ---------------------------------------------------------
    pytest.param(
        one_event(1, claim_in_transaction=True, client_w="w1", max_deferrals=5, lifetime=30.0),
        # A primary-secondary-arbiter set with the secondary down and a client that says w=1.
        # h1's commit applies on the primary, never reaches a majority (its reply is lost: a
        # wtimeout), the majority read does not see it: COMMIT_AMBIGUOUS. The redelivered
        # copy's claim finds the completion on the primary; a w:1 claim would ACK it as a
        # duplicate, and the failover then rolls the completion back: the event lost. A majority
        # claim waits for the majority instead and defers; after the failover the event runs.
        [
            Replication("down"),
            Deliver(0),
            Drive("h1", 3),
            Drive("h1", 1, Fault.LOST),
            Drive("h1", 1),
            Wait(1),
            Deliver(1),
            Drive("h2", 1),
            Wait(1),
            Wait(1),
            Replication("failover"),
        ],
        "the completion of e1 by txn 1 is rolled back",
        id="w1-claim-after-a-commit-that-is-rolled-back",
    ),
    pytest.param(
        one_event(2, lifetime=30.0),
        # h1's transaction holds the record (its completion is written, its handler runs past
        # the deadline); h2's claim waits behind it until its maxTimeMS: deferred LEASE_BUSY, no
        # retry spent (without a maxTimeMS it would wait until the deadline: a timeout, a retry).
        [Deliver(0), Drive("h1", 2), Deliver(1), *[Wait(4)] * 5, Wait(1)],
        "c1/h2(e1#m2) concludes deferred LEASE_BUSY",
        id="claim-waits-behind-a-transaction",
    ),
    pytest.param(
        one_event(1, max_deferrals=2),
        # The claim fails on two consumers in turn: each deferral is counted in a counting
        # record (the process's own count would say 1 on each), the second dead-letters.
        [
            Deliver(0),
            Drive("h1", 1, Fault.ERROR),
            Drive("h1", 1),
            Deliver(1),
            Drive("h2", 1, Fault.ERROR),
            Drive("h2", 1),
        ],
        "c1/h2(e1#m1) settles deferred: dead_lettered QUEUE_DEFERRALS_EXHAUSTED",
        id="a-failed-claims-deferral-is-counted",
    ),
    pytest.param(
        one_event(1, claim_in_transaction=True, max_deferrals=2),
        # A first-time copy's claim in its transaction is refused (MONGO_ERROR): no record of its
        # own counts that deferral, a counting record does; the redelivery's claim fails too.
        [
            Deliver(0),
            Drive("h1", 1, Fault.ERROR),
            Drive("h1", 1),
            Deliver(1),
            Drive("h2", 1, Fault.ERROR),
            Drive("h2", 1),
        ],
        "c1/h2(e1#m1) settles deferred: dead_lettered QUEUE_DEFERRALS_EXHAUSTED",
        id="a-first-time-copys-deferral-is-counted",
    ),
    pytest.param(
        one_event(1, claim_in_transaction=True, lifetime=4.0, deadline=30.0, replay_budget=3),
        # The handler runs past the transaction lifetime twice (the reaper aborts its transaction
        # each time): one more try after the first, then QUEUE_TRANSACTION_EXPIRED, not replays.
        # The expiry's count creates the record, so the second try's claim in its transaction
        # finds it and the lease claim takes over.
        [
            Deliver(0),
            Drive("h1", 1),
            Wait(4),
            Wait(1),
            Drive("h1", 3),
            Wait(0.5),
            Drive("h1", 3),
            Wait(4),
            Wait(1),
            Drive("h1", 4),
        ],
        "c0/h1(e1#m1) settles permanent: dead_lettered QUEUE_TRANSACTION_EXPIRED",
        id="handler-outlives-the-transaction-lifetime",
    ),
    pytest.param(
        one_event(1, lifetime=4.0, deadline=30.0, replay_budget=3),
        # The same on the lease path: the second expiry's count ends it; no third run.
        [
            Deliver(0),
            Drive("h1", 2),
            Wait(4),
            Wait(1),
            Drive("h1", 3),
            Wait(0.5),
            Drive("h1", 1),
            Wait(4),
            Wait(1),
            Drive("h1", 4),
        ],
        "c0/h1(e1#m1) settles permanent: dead_lettered QUEUE_TRANSACTION_EXPIRED",
        id="handler-outlives-the-transaction-lifetime-on-the-lease-path",
    ),
    pytest.param(
        one_event(1, lifetime=4.0, deadline=20.0, max_retries=1, replay_budget=3),
        # The first attempt outlives the lifetime (reaped), the second too, and the deadline cuts
        # it off: both count in the record, which the cancelled attempt's release keeps; the
        # retry copy's claim finds two expirations and dead-letters it without a third run.
        [
            Deliver(0),
            Drive("h1", 2),
            Wait(4),
            Wait(1),
            Drive("h1", 3),
            Wait(0.5),
            Drive("h1", 1),
            *[Wait(4)] * 3,
            Wait(2.5),
            Drive("h1", 3),
            Deliver(0),
            Drive("h2", 2),
        ],
        "c0/h2(e1#m2) settles permanent: dead_lettered QUEUE_TRANSACTION_EXPIRED",
        id="lifetime-counted-across-deliveries",
    ),
    pytest.param(
        one_event(2, lifetime=4.0, deadline=30.0),
        # The reaper aborts h1's transaction while its handler runs, h1's lease has expired: h2
        # takes the record and runs its handler while h1's still runs (docs/inbox.md says so);
        # the effects still commit once.
        [Deliver(0), Drive("h1", 2), Wait(4), Wait(1), Deliver(1), Drive("h2", 2), Drive("h2", 2), Drive("h1", 5)],
        "whose transaction the server aborted (reaper), still runs",
        id="a-reaped-attempts-handler-still-runs",
    ),
    pytest.param(
        one_event(3, lease_seconds=30, max_deferrals=3),
        # h1 holds a live lease. h2 and h3 are deferred (LEASE_HELD), h2 on a consumer that then
        # crashes and starts again with an empty memory: the count is the record's, so the third
        # deferral dead-letters (the broker counts nothing, as RabbitMQ 4.3 does not for a nack).
        [
            Deliver(0),
            Drive("h1", 1),
            Deliver(1),
            Drive("h2", 1),
            Crash(1),
            Deliver(1),
            Drive("h3", 1),
            Deliver(1),
            Drive("h4", 1),
        ],
        "c1.1/h4(e1#m2) settles deferred: dead_lettered QUEUE_DEFERRALS_EXHAUSTED",
        id="deferrals-counted-across-a-crash",
    ),
    pytest.param(
        one_event(claim_in_transaction=True),
        # The secondary lags: h1's commit waits for the majority; h2, a first-time copy, finds the
        # completion in its snapshot, and its read-only commit waits for the majority too, and
        # runs out of its maxTimeMS: the lease claim (also waiting) decides: deferred.
        [
            Replication("lag"),
            Deliver(0),
            Drive("h1", 3),
            Deliver(1),
            Drive("h2", 2),
            Wait(1),
            Drive("h2", 1),
            Wait(1),
            Drive("h2", 1),
            Wait(1),
            Replication("catch_up"),
        ],
        "c1/h2(e1#m2) concludes deferred MONGO_UNAVAILABLE",
        id="read-only-commit-waits-for-the-majority",
    ),
    # -- the lease: stale owners, takeovers, the held lease --------------------------------------
    pytest.param(
        one_event(backoff=3.0),
        # The renewal h1's heartbeat sent at t=1.67 lands a little after the takeover.
        [*STALLED_THEN_TAKEN_OVER, Wait(0.1), Drive("hb0", 1)],
        "update_one(renewal) orders.v1|e1 by a stale owner",
        id="stale-owner-renews",
    ),
    pytest.param(
        one_event(1, lease_seconds=1, max_deferrals=1, replay_budget=0, replication_faults=False),
        # c0 dies while its completion write, the transaction's first command, is unanswered: that
        # write is bounded too, times out, and the transaction never existed on the server. The
        # copy comes back to the restarted process, which claims the expired lease and applies it.
        [Deliver(0), Drive("h1", 1), Crash(0), Wait(1)],
        "c0.1/h2(e1#m1) settles success: acked",
        id="crash-while-the-completion-write-is-unanswered",
    ),
    pytest.param(
        one_event(max_wait=5.0),
        # h1 claims, then its completion write waits (its bound, 5 s, outlasts the lease); the lease
        # expires and h2 takes it over; h1's fenced completion matches nothing, and its release
        # matches nothing either.
        [Deliver(0), Drive("h1", 1), Wait(3), Deliver(1), Drive("h2", 1), Drive("h1", 2)],
        "find_one_and_update(deferral-release) orders.v1|e1 by a stale owner",
        id="stale-owner-completes-then-releases",
    ),
    pytest.param(
        one_event(writes=("ledger:e1",), max_wait=4.0),
        # h1's handler fails; before its release (deleting) lands, its lease expires and h2 takes it.
        [Deliver(0), Drive("h1", 3, Fault.PERMANENT), Wait(3), Deliver(1), Drive("h2", 1), Drive("h1", 2)],
        "delete_one orders.v1|e1 by a stale owner",
        id="stale-owner-hands-off",
    ),
    pytest.param(
        one_event(max_deferrals=1),
        # h2 claims one second before h1's lease expires: held; its first deferral is the bound.
        [Deliver(0), Drive("h1", 1), Wait(1), Deliver(1), Drive("h2", 2)],
        "c1/h2(e1#m2) settles deferred: dead_lettered QUEUE_DEFERRALS_EXHAUSTED",
        id="live-lease-is-held",
    ),
    pytest.param(
        one_event(1),
        # The consumer crashes right after claiming; its completion write still lands (an
        # orphaned transaction, reaped later); the redelivery completes after that.
        [Deliver(0), Drive("h1", 1), Drive("h1", 1, Fault.CRASH)],
        "c0.1/h2(e1#m1) settles success: acked",
        id="crashed-owner-completes-after-expiry",
    ),
    # -- commits whose reply is lost, replays --------------------------------------------------
    pytest.param(
        one_event(lease_seconds=1, max_wait=2.0),
        # h1's commit reply is lost before it applied; the server aborts it, h1's lease expires,
        # h2 completes the event; h1 reconciles: a duplicate, not its commit.
        [
            Deliver(0),
            Drive("h1", 4, Fault.PENDING),
            ServerEvent(1),
            Wait(1.5),
            Deliver(1),
            Drive("h2", 4),
            Drive("h1", 1),
        ],
        "c0/h1(e1#m1) concludes duplicate",
        id="reconcile-finds-another-completion",
    ),
    pytest.param(
        one_event(1),
        [Deliver(0), Drive("h1", 3), Drive("h1", 1, Fault.LOST), Drive("h1", 1)],
        "c0/h1(e1#m1) settles success: acked",
        id="commit-applied-reply-lost",
    ),
    pytest.param(
        one_event(1, commit_retries=1),
        # The reply is lost, the commit lands late, the retry finds it applied.
        [Deliver(0), Drive("h1", 3), Drive("h1", 1, Fault.PENDING), ServerEvent(0), Wait(0.5), Drive("h1", 2)],
        "already applied: ok",
        id="late-commit-then-retry",
    ),
    pytest.param(
        one_event(1, commit_retries=1),
        # The commit's reply is lost twice before it applied: ambiguous, deferred. The release
        # waits for the transaction still in flight (the reaper aborts it); the redelivery completes.
        [
            Deliver(0),
            Drive("h1", 3),
            Drive("h1", 1, Fault.PENDING),
            Wait(0.5),
            Drive("h1", 1, Fault.PENDING),
            Drive("h1", 1),
        ],
        "c0/h1(e1#m1) concludes deferred COMMIT_AMBIGUOUS",
        id="commit-result-stays-unknown",
    ),
    pytest.param(
        one_event(1, replay_budget=1, max_deferrals=1),
        # Two commits fail transiently with a budget of one replay: deferred, at the deferral bound.
        [
            Deliver(0),
            Drive("h1", 3),
            Drive("h1", 1, Fault.TRANSIENT),
            Wait(0.5),
            Drive("h1", 2),
            Drive("h1", 1, Fault.TRANSIENT),
            Drive("h1", 1),
        ],
        "c0/h1(e1#m1) settles deferred: dead_lettered QUEUE_DEFERRALS_EXHAUSTED",
        id="replay-budget-spent",
    ),
    pytest.param(
        one_event(1, replay_budget=0, max_deferrals=2),
        # The replay budget is spent on two consumers in turn: each deferral release counts in
        # the record (each process alone would say 1), so the second dead-letters.
        [
            Deliver(0),
            Drive("h1", 2, Fault.TRANSIENT),
            Drive("h1", 1),
            Deliver(1),
            Drive("h2", 2, Fault.TRANSIENT),
            Drive("h2", 1),
        ],
        "c1/h2(e1#m1) settles deferred: dead_lettered QUEUE_DEFERRALS_EXHAUSTED",
        id="a-released-lease-counts-its-deferral",
    ),
    pytest.param(
        one_event(1),
        # A commit that fails without UnknownTransactionCommitResult did not apply: replay (docs/inbox.md, step 5).
        [Deliver(0), Drive("h1", 3), Drive("h1", 1, Fault.TRANSIENT)],
        "c0/h1(e1#m1) handler starts (run 2",
        id="failed-commit-replays",
    ),
    # -- a first-time copy claims inside its transaction -----------------------------------------
    pytest.param(
        one_event(writes=("ledger:e1",), claim_in_transaction=True),
        # Two first-time copies at once: h1's transaction writes the record first; h2's write of
        # it conflicts at once (before its handler ran); h2 takes the lease claim, a duplicate.
        [Deliver(0), Deliver(1), Drive("h1", 1), Drive("h2", 1), Drive("h1", 4), Drive("h2", 2)],
        "c1/h2(e1#m2) settles duplicate",
        id="first-claims-conflict-at-the-write",
    ),
    pytest.param(
        one_event(claim_in_transaction=True),
        # h1's claim in its transaction fails transiently: it takes the lease. A first-time copy
        # then finds the lease record (contended), takes the lease claim: held, deferred.
        [Deliver(0), Drive("h1", 1, Fault.TRANSIENT), Drive("h1", 1), Deliver(1), Drive("h2", 2)],
        "c1/h2(e1#m2) concludes deferred LEASE_HELD",
        id="first-claim-finds-a-lease",
    ),
    pytest.param(
        one_event(1, claim_in_transaction=True, replay_budget=0),
        # A transient error of the claim in the transaction is a contention, not a replay: with
        # no replay budget at all the lease claim still follows, and the event completes.
        [Deliver(0), Drive("h1", 1, Fault.TRANSIENT), Drive("h1", 4)],
        "c0/h1(e1#m1) settles success: acked",
        id="first-claim-contention-is-no-replay",
    ),
    pytest.param(
        one_event(claim_in_transaction=True),
        [Deliver(0), Drive("h1", 3), Deliver(1), Drive("h2", 2)],
        "c1/h2(e1#m2) settles duplicate",
        id="first-claim-finds-the-completion",
    ),
    pytest.param(
        one_event(1, claim_in_transaction=True),
        # The commit applied, its reply was lost: reconciliation recognises this owner's record.
        [Deliver(0), Drive("h1", 2), Drive("h1", 1, Fault.LOST), Drive("h1", 1)],
        "c0/h1(e1#m1) settles success: acked",
        id="first-claim-commit-reply-lost",
    ),
    pytest.param(
        one_event(1, writes=("ledger:e1",), claim_in_transaction=True, max_retries=1),
        # The handler fails: nothing to release (the record was never committed); the retry copy
        # is a new message and claims in its transaction again.
        [Deliver(0), Drive("h1", 2, Fault.RETRYABLE), Deliver(0), Drive("h2", 4)],
        "c0/h2(e1#m2) settles success: acked",
        id="first-claim-handler-fails-then-retry",
    ),
]


@pytest.mark.parametrize(("cfg", "moves", "reaches"), SCENARIOS)
def test_protocol_scenario(cfg: Config, moves: list[Move], reaches: str) -> None:
    machine = play(cfg, moves)
    assert any(reaches in line for line in machine.trace), "\n".join(machine.trace)


# -- the mutation run (not in CI): each mutant must make the model fail -------------------------------

MUTATION_RUN = os.environ.get("LILY_MUTANTS") == "1"


@pytest.mark.skipif(not MUTATION_RUN, reason="the mutation run: set LILY_MUTANTS=1")
@pytest.mark.parametrize("mutant", MUTANTS if MUTATION_RUN else [None], ids=lambda m: m.name if m else "off")
def test_mutant_is_caught(mutant: Mutant) -> None:
    """Every non-equivalent mutant of the inbox or of its record protocol fails a scenario or a random run."""
    if mutant.equivalent:
        pytest.skip(f"equivalent under the model: {mutant.why}")
    with mutant.applied() as machine:
        found = hunt(machine, EXAMPLES, derandomize=False)
    caught = found.by_scenario or found.by_machine
    assert caught is not None, f"{mutant.name} survived the scenarios and {EXAMPLES} random runs"
    assert caught.invariant in mutant.caught_by, str(caught)


def first_violation(cases: list[Callable[[], object]]) -> InvariantViolation | None:
    for case in cases:
        try:
            case()
        except InvariantViolation as exc:
            return exc
    return None
