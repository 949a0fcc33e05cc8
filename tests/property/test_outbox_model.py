"""A protocol model of the outbox records (docs/outbox.md) as a hypothesis state machine.

Writers commit transactions of records, born claimed by their process's dispatcher or
free; dispatchers publish them from memory and mark them in batches; relays claim due
records in batches, publish and mark them; any of them may crash at any step (losing
what it held in memory), a publish may be refused, and a server clock that a rule
advances decides expiry. Every step the model applies to its collection is the Python
transition of :mod:`lily_mongo._outbox.protocol` (``claim_transition``,
``mark_transition``, ``failure_transition``, ``is_due``, ``publish_order``,
``failed_attempt``), which an integration test holds equal to the MongoDB updates.

Invariants (each failure names one, in brackets):

* ``confirmed-first`` -- a record is marked published only after a confirmed publish of it;
* ``fencing`` -- a mark or a failure write by a holder whose claim was taken over changes nothing;
* ``exclusive-claim`` -- a relay never claims a record while another holder's claim on it is live;
* ``monotone`` -- a published or failed record never becomes pending again (nothing in the
  protocol re-opens one; an operator may);
* ``write-order`` -- one holder publishes the records of one transaction that are on their first
  attempt in their write order (a refused record is retried later, after the others);
* ``at-least-once`` -- in the teardown, with no more crashes or refusals: once the clock passes
  every claim and backoff, a relay drains everything, and every committed record is published
  at least once, or parked as failed after ``max_attempts`` refusals.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import itertools
import os
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from lily_mongo._outbox import protocol
from tests.support.outbox import written_record

MODEL = settings(
    max_examples=int(os.environ.get("LILY_MODEL_EXAMPLES", "250")),
    stateful_step_count=int(os.environ.get("LILY_MODEL_STEPS", "30")),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
CLAIM_SECONDS = 10.0
RETENTION = 3600.0
MAX_ATTEMPTS = 3
T0 = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)


@dataclasses.dataclass
class Holder:
    """A dispatcher (one token for its life) or a relay's batch (a token per batch), with what it holds in memory."""

    name: str
    token: str
    relay: bool
    queue: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # to publish, in order
    marks: list[str] = dataclasses.field(default_factory=list)  # confirmed, not marked yet
    failures: list[tuple[str, protocol.Failure]] = dataclasses.field(default_factory=list)


class OutboxModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = T0
        self.records: dict[str, dict[str, Any]] = {}
        self.txns: dict[str, tuple[str, ...]] = {}  # transaction -> its record ids in write order
        self.sent: collections.Counter[str] = collections.Counter()  # confirmed publishes per record
        self.published_order: dict[str, list[str]] = collections.defaultdict(list)  # per holder token
        self.ids = itertools.count()
        self.tokens = itertools.count()
        self.dispatcher = self._new_dispatcher()
        self.relays: list[Holder] = []
        self.found: list[list[str]] = []  # ids a relay found due and has not claimed yet
        self.ever_closed: set[str] = set()

    def _new_dispatcher(self) -> Holder:
        return Holder("dispatcher", f"d{next(self.tokens)}", relay=False)

    # -- writers ---------------------------------------------------------------------------------

    @rule(size=st.integers(1, 4), claimed=st.booleans())
    def commit_a_transaction(self, size: int, claimed: bool) -> None:
        """A transaction commits ``size`` records, born claimed by the dispatcher or free; the
        dispatcher is handed the claimed ones."""
        txn = f"t{next(self.ids)}"
        claim = (
            protocol.Claim("proc", self.dispatcher.token, self.now + datetime.timedelta(seconds=CLAIM_SECONDS))
            if claimed
            else None
        )
        ids = []
        for seq in range(size):
            record_id = f"{txn}.{seq}"
            record = written_record(
                record_id, written_at=self.now, seq=seq, claim=claim, body=b"", headers={}, content_type=None
            )
            self.records[record_id] = record
            ids.append(record_id)
        self.txns[txn] = tuple(ids)
        if claimed:
            self.dispatcher.queue += [dict(self.records[i]) for i in ids]

    # -- publishing ------------------------------------------------------------------------------------

    def _publish(self, holder: Holder, count: int, refused: bool) -> None:
        for record in holder.queue[:count]:
            if not holder.relay and protocol.is_free(record, self.now):
                continue  # the dispatcher leaves a record whose claim expired to the relays
            if refused:
                failure = protocol.failed_attempt(
                    record.get("attempts", 0),
                    "nacked",
                    max_attempts=MAX_ATTEMPTS,
                    backoff_base=1.0,
                    backoff_max=4.0,
                    jitter=0.5,
                )
                holder.failures.append((record["_id"], failure))
            else:
                self.sent[record["_id"]] += 1
                if not record.get("attempts"):  # the order promise is for records on their first attempt
                    self.published_order[holder.token].append(record["_id"])
                holder.marks.append(record["_id"])
        del holder.queue[:count]

    def _flush(self, holder: Holder) -> None:
        for record_id in holder.marks:
            record = self.records[record_id]
            after = protocol.mark_transition(record, holder.token, now=self.now, retention_seconds=RETENTION)
            if after is None:
                continue
            assert record.get("claim_token") == holder.token, "[fencing] a mark landed under another claim"
            assert self.sent[record_id] >= 1, "[confirmed-first] marked without a confirmed publish"
            self.records[record_id] = after
        for record_id, failure in holder.failures:
            record = self.records[record_id]
            after = protocol.failure_transition(record, holder.token, failure, self.now)
            if after is None:
                continue
            assert record.get("claim_token") == holder.token, "[fencing] a failure landed under another claim"
            self.records[record_id] = after
        holder.marks, holder.failures = [], []

    @rule(count=st.integers(1, 5), refused=st.booleans())
    def dispatcher_publishes(self, count: int, refused: bool) -> None:
        self._publish(self.dispatcher, count, refused)

    @rule()
    def dispatcher_marks(self) -> None:
        self._flush(self.dispatcher)

    @rule()
    def dispatcher_process_crashes(self) -> None:
        """The writer's process dies: its in-memory records and marks are gone; a new dispatcher starts."""
        self.dispatcher = self._new_dispatcher()

    @rule(size=st.integers(1, 6))
    def a_relay_finds_due_records(self, size: int) -> None:
        """The first command of a batch claim: the ids of due records (they may be taken before the claim)."""
        due = [r for r in self.records.values() if protocol.is_due(r, self.now)]
        self.found.append([r["_id"] for r in protocol.publish_order(due)][:size])

    @rule(data=st.data())
    def a_relay_claims_what_it_found(self, data: st.DataObject) -> None:
        """The claim (one update_many over the ids found, with a fresh token), then the read-back."""
        if not self.found:
            return
        ids = data.draw(st.sampled_from(self.found))
        self.found.remove(ids)
        self._claim(ids)

    def _claim(self, ids: list[str]) -> None:
        relay = Holder(f"relay{next(self.ids)}", f"r{next(self.tokens)}", relay=True)
        claimed = []
        for record_id in ids:
            before = self.records[record_id]
            after = protocol.claim_transition(
                before, owner=relay.name, token=relay.token, now=self.now, claim_seconds=CLAIM_SECONDS
            )
            if after is None:
                continue
            expires = before.get("claim_expires")
            assert expires is None or expires <= self.now, "[exclusive-claim] took a live claim"
            assert before["status"] == protocol.PENDING, "[exclusive-claim] claimed a closed record"
            self.records[record_id] = after
            claimed.append(dict(after))
        relay.queue = protocol.publish_order(claimed)
        if relay.queue:
            self.relays.append(relay)

    @rule(data=st.data(), count=st.integers(1, 6), refused=st.booleans())
    def a_relay_publishes(self, data: st.DataObject, count: int, refused: bool) -> None:
        if self.relays:
            relay = data.draw(st.sampled_from(self.relays))
            self._publish(relay, count, refused)

    @rule(data=st.data())
    def a_relay_marks(self, data: st.DataObject) -> None:
        if self.relays:
            relay = data.draw(st.sampled_from(self.relays))
            self._flush(relay)
            if not relay.queue:
                self.relays.remove(relay)

    @rule(data=st.data())
    def a_relay_crashes(self, data: st.DataObject) -> None:
        if self.relays:
            self.relays.remove(data.draw(st.sampled_from(self.relays)))

    @rule(seconds=st.sampled_from([0.5, 3.0, CLAIM_SECONDS + 1]))
    def time_passes(self, seconds: float) -> None:
        self.now += datetime.timedelta(seconds=seconds)

    # -- invariants ---------------------------------------------------------------------------------------

    @invariant()
    def closed_records_stay_closed(self) -> None:
        for record_id, record in self.records.items():
            if record["status"] != protocol.PENDING:
                self.ever_closed.add(record_id)
            elif record_id in self.ever_closed:
                raise AssertionError(f"[monotone] {record_id} became pending again")

    @invariant()
    def each_holder_keeps_the_write_order(self) -> None:
        for order in self.published_order.values():
            for txn, ids in self.txns.items():
                mine = [i for i in order if i.startswith(f"{txn}.")]
                # Refused records may be skipped, but what one holder published of a transaction is in order.
                positions = [ids.index(i) for i in mine]
                assert positions == sorted(positions), f"[write-order] {txn}: {mine}"

    def teardown(self) -> None:
        """No more crashes or refusals: drain with a healthy relay until nothing is due."""
        for _ in range(100):
            self.now += datetime.timedelta(seconds=CLAIM_SECONDS + 5)
            due = [r for r in self.records.values() if protocol.is_due(r, self.now)]
            self._claim([r["_id"] for r in protocol.publish_order(due)])
            for relay in list(self.relays):
                self._publish(relay, len(relay.queue), refused=False)
                self._flush(relay)
            self.relays = []
            if not any(protocol.is_due(r, self.now) for r in self.records.values()):
                break
        for record_id, record in self.records.items():
            if record["status"] == protocol.FAILED:
                assert record["attempts"] >= MAX_ATTEMPTS, f"[at-least-once] {record_id} parked early"
                continue
            assert record["status"] == protocol.PUBLISHED, f"[at-least-once] {record_id} is {record['status']}"
            assert self.sent[record_id] >= 1, f"[at-least-once] {record_id} never published"


TestOutboxModel = OutboxModel.TestCase
TestOutboxModel.settings = MODEL
