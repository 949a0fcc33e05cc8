"""Seeded mutants of the inbox for the protocol model, and their score.

The model (``tests/property/test_inbox_model.py``) runs the shipped ``Inbox``, so a mutant is
either an edit of the source of a module of ``lily_mongo/_inbox/`` (or of the transaction
skeleton, ``lily_mongo/_mongo/transactions.py``), loaded as a copy of the package that the
machine runs instead (:attr:`InboxModel.INBOX`), or a replacement of one function of the
record protocol (:mod:`lily_mongo._inbox.protocol`, :mod:`lily_mongo._inbox.first_claim`) or of the
transaction rules (:mod:`lily_mongo._mongo.rules`), which the inbox and the simulated server call through
their modules. Two ways to run them:

* ``LILY_MUTANTS=1 uv_run pytest --noconftest tests/property/test_inbox_model.py -k mutant``
  (every non-equivalent mutant must be caught, by an invariant it names);
* ``uv_run python -m tests.property.inbox_mutants [examples] [name filter]`` prints the score
  table; ``--source DIR`` instead runs the scenarios and the random machine against another
  revision's ``lily_mongo/_inbox/`` folder and prints what they find.

A mutant marked ``equivalent`` cannot be told apart from the original by any run of the
model; ``why`` says why (the table still runs it, to show that it survives). A mutant with
``wire=False`` is run with the wire checks (``majority``, ``bounded-wait``) off, so the run
shows what the hole does rather than that the command looks wrong on the wire.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import logging
import sys
import time
import types
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import lily_mongo._inbox as shipped_inbox
import lily_mongo._inbox.first_claim as first_claim
import lily_mongo._inbox.protocol as protocol
import lily_mongo._mongo.rules as rules
from lily_mongo._inbox.first_claim import FirstClaim
from lily_mongo._inbox.protocol import COMPLETED, LEASED, Claim, ClaimKind, Heartbeat, Reconciled
from lily_mongo._mongo.rules import ErrorStep

if TYPE_CHECKING:
    from tests.property.test_inbox_model import Config, Move

Record = Any
PACKAGE = Path(shipped_inbox.__file__).parent.parent  # lily_mongo/
TARGETS = {
    "protocol": protocol,
    "first_claim": first_claim,
    "rules": rules,
}  # the modules whose functions a mutant may replace

# The originals, captured before any patching (a mutant delegates to them).
read_claim = protocol.read_claim
claim_transition = protocol.claim_transition
completion_transition = protocol.completion_transition
renewal_transition = protocol.renewal_transition
release_transition = protocol.release_transition
count_transition = protocol.count_transition
classify_error = rules.classify_error
next_after_replay = rules.next_after_replay
reconcile = protocol.reconcile
may_renew = protocol.may_renew
heartbeat_verdict = protocol.heartbeat_verdict
read_first_claim = first_claim.read_first_claim
first_claim_falls_back = first_claim.first_claim_falls_back
first_claim_transition = first_claim.first_claim_transition
may_try_again_after_expiry = protocol.may_try_again_after_expiry

Edit = tuple[str, str, str]  # (a file under lily_mongo/, e.g. "_inbox/store.py"; its text; the text instead)


@dataclass(frozen=True)
class Mutant:
    name: str
    caught_by: tuple[str, ...]  # the invariants that may report it (none: equivalent)
    why: str = ""  # for an equivalent mutant: why no run of the model can tell
    target: str = ""  # "<module>.<function>", a module of TARGETS: the function it replaces
    function: Callable[..., Any] | None = None
    edits: tuple[Edit, ...] = ()  # edits of the inbox's (or the skeleton's) sources
    wire: bool = True  # run with the wire checks on

    @property
    def equivalent(self) -> bool:
        return not self.caught_by

    @contextlib.contextmanager
    def applied(self) -> Iterator[type[Any]]:
        """The machine class that runs this mutant, with the target module patched meanwhile."""
        from tests.property.test_inbox_model import InboxModel

        with contextlib.ExitStack() as stack:
            module = stack.enter_context(edited_inbox(self.edits, self.name)) if self.edits else shipped_inbox
            machine = type(
                f"Mutant_{self.name.replace('-', '_')}", (InboxModel,), {"INBOX": module, "CHECK_WIRE": self.wire}
            )
            if self.target:
                where, _, attribute = self.target.partition(".")
                stack.enter_context(mock.patch.object(TARGETS[where], attribute, self.function))
            yield machine


class _Copies(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves copies of packages of lily_mongo under other names, from their files with ``sources`` replacing
    some of them; references between the copied packages point at the copies."""

    def __init__(self, names: Mapping[str, str], sources: Mapping[str, str], label: str) -> None:
        self.names = names  # "_inbox" -> "_inbox_mutant_3"
        self.sources = sources  # "_inbox/store.py" -> its edited text
        self.label = label
        self.directories = {f"lily_mongo.{copy}": original for original, copy in names.items()}

    def _file(self, fullname: str) -> tuple[str, bool] | None:
        for package, original in self.directories.items():
            if fullname == package:
                return f"{original}/__init__.py", True
            if fullname.startswith(package + "."):
                relative = f"{original}/{fullname[len(package) + 1 :]}.py"
                return (relative, False) if (PACKAGE / relative).exists() else None
        return None

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        found = self._file(fullname)
        if found is None:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=found[1])

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        found = self._file(module.__name__)
        assert found is not None
        relative = found[0]
        source = self.sources.get(relative) or (PACKAGE / relative).read_text()
        for original, copy in self.names.items():
            source = source.replace(f"from ..{original} import", f"from ..{copy} import")
            source = source.replace(f"from ..{original}.", f"from ..{copy}.")
        exec(compile(source, f"<{self.label} of lily_mongo/{relative}>", "exec"), module.__dict__)


_copy_numbers = itertools.count(1)


@contextlib.contextmanager
def edited_inbox(edits: tuple[Edit, ...], label: str) -> Iterator[types.ModuleType]:
    """A copy of ``lily_mongo._inbox`` (and of every other package an edit touches) with ``edits`` applied."""
    sources: dict[str, str] = {}
    for path, old, new in edits:
        source = sources.get(path) or (PACKAGE / path).read_text()
        assert source.count(old) == 1, f"the mutant's target is no longer in lily_mongo/{path} once: {old[:80]!r}"
        sources[path] = source.replace(old, new)
    number = next(_copy_numbers)
    packages = {"_inbox"} | {path.split("/")[0] for path, _, _ in edits}
    names = {package: f"{package}_mutant_{number}" for package in sorted(packages)}
    yield from _loaded(names, sources, label)


@contextlib.contextmanager
def other_inbox(directory: Path) -> Iterator[types.ModuleType]:
    """Another revision's ``lily_mongo/_inbox/`` folder, loaded as a copy of the package."""
    sources = {f"_inbox/{file.name}": file.read_text() for file in directory.glob("*.py")}
    yield from _loaded({"_inbox": f"_inbox_other_{next(_copy_numbers)}"}, sources, "another revision")


def _loaded(names: Mapping[str, str], sources: Mapping[str, str], label: str) -> Iterator[types.ModuleType]:
    finder = _Copies(names, sources, label)
    sys.meta_path.insert(0, finder)
    try:
        yield importlib.import_module(f"lily_mongo.{names['_inbox']}")
    finally:
        sys.meta_path.remove(finder)
        for name in [name for name in sys.modules if any(f"lily_mongo.{copy}" in name for copy in names.values())]:
            del sys.modules[name]


# -- edits of the inbox's sources ----------------------------------------------------------------------

ATTEMPTS = "_inbox/attempts.py"
COMPLETION = """            else:
                bound = in_time(lease)
                try:
                    with pymongo.timeout(bound):
                        done = await store.records.update_one(
                            protocol.fence(lease.key, lease.owner, lease.token),
                            protocol.completion_update(retention_seconds=store.options.retention_seconds),
                            session=session,
                        )
                except PyMongoError as exc:
                    await self._store.abort(session)
                    if timed_out(exc):  # a wait before the handler ran: infrastructure, not a retry
                        raise Deferral(store.claim_failed(exc, bound)) from exc
                    raise operation_failed(exc, "the completion write") from exc
                if done.matched_count == 0:
                    await self._store.abort(session)
                    return PipelineResult(Outcome.DEFERRED, ErrorCode.LEASE_LOST, "the lease was taken over")
"""
AFTER_THE_HANDLER = """            if result.outcome is not Outcome.SUCCESS:
                await self._store.abort(session)
                return result
"""
# Two steps of Attempts._attempt swapped: the handler runs before the completion write.
COMPLETION_AFTER_THE_HANDLER = (
    (ATTEMPTS, COMPLETION, ""),
    (
        ATTEMPTS,
        AFTER_THE_HANDLER,
        AFTER_THE_HANDLER + COMPLETION.replace("            else:\n", "            if not lease.first:\n"),
    ),
)
STORE = "_inbox/store.py"
MAJORITY_HANDLE = """        self._outside = self.records.with_options(
            write_concern=WriteConcern("majority"), read_concern=ReadConcern("majority")
        )"""
CLIENTS_WRITE_CONCERN = (
    (
        STORE,
        MAJORITY_HANDLE,
        """        self._outside = self.records.with_options(read_concern=ReadConcern("majority"))""",
    ),
)
CLAIM_BOUND = """        with pymongo.timeout(wait):
            for _ in range(3):
                try:
                    record: dict[str, Any] | None = await self._outside.find_one_and_update(
                        {"_id": key}, pipeline, upsert=True, return_document=ReturnDocument.AFTER
                    )
                except DuplicateKeyError:
                    continue  # two concurrent upserts of a new key: the loser retries as an update
                assert record is not None
                return protocol.read_claim(record, owner)
"""
UNBOUNDED_CLAIM = (
    (STORE, CLAIM_BOUND, CLAIM_BOUND.replace("        with pymongo.timeout(wait):\n", "        if True:\n")),
)
UNBOUNDED_RENEWAL = (
    (
        "_inbox/heartbeat.py",
        "        with pymongo.timeout(min(lease.wait, self._seconds)):\n",
        "        if True:\n",
    ),
)
INBOX = "_inbox/inbox.py"
NO_COUNT_AFTER_A_FAILED_CLAIM = (
    (
        INBOX,
        """            execution.result = self._store.claim_failed(exc, bound)
            await self._count_into(execution, claimant)""",
        """            execution.result = self._store.claim_failed(exc, bound)""",
    ),
)
NO_COUNT_FOR_A_FIRST_TIME_DEFERRAL = (
    (
        INBOX,
        """            # No record of its own counts this deferral: a counting record does.
            await self._count_into(execution, first)""",
        """            pass""",
    ),
)
DUPLICATE_ABORTS = (
    (
        ATTEMPTS,
        """                    try:
                        with pymongo.timeout(in_time(lease)):
                            await session.commit_transaction()
                    except PyMongoError:""",
        """                    try:
                        await self._store.abort(session)
                    except PyMongoError:""",
    ),
)
NO_CLAIM_TIME_EXPIRY_CHECK = (
    (
        INBOX,
        "            if protocol.may_try_again_after_expiry(claim.expirations):\n",
        "            if True:\n",
    ),
)
CANCELLED_RELEASE_DELETES = (
    (
        STORE,
        "protocol.cancelled_release_filter(lease.key, lease.owner, lease.token)",
        "fence",
    ),
)
NO_CANCEL_CHECK = (
    (
        "_mongo/transactions.py",
        "            raise_if_cancel_requested()  # cancelled while the attempt ignored it: no replay\n",
        "",
    ),
)
EXPIRY_NOT_IN_THE_RECORD = (
    (
        ATTEMPTS,
        "        counted = await self._store.count(lease, protocol.EXPIRATIONS, bound=in_time(lease))\n",
        "        counted = None\n",
    ),
)


# -- read_claim ---------------------------------------------------------------------------------


def held_as_leased(record: Record, owner: str) -> Claim:
    got = read_claim(record, owner)
    return Claim(ClaimKind.LEASED, token=int(record["token"])) if got.kind is ClaimKind.HELD else got


def held_as_duplicate(record: Record, owner: str) -> Claim:
    got = read_claim(record, owner)
    return Claim(ClaimKind.DUPLICATE) if got.kind is ClaimKind.HELD else got


def completed_as_leased(record: Record, owner: str) -> Claim:
    if record.get("state") == COMPLETED:
        return Claim(ClaimKind.LEASED, token=int(record["token"]))
    return read_claim(record, owner)


# -- claim_transition ---------------------------------------------------------------------------


def _claim(
    record: Record | None,
    *,
    free: Callable[[dict[str, Any], datetime.datetime], bool] | None = None,
    token_step: int = 1,
    deferral_step: int = 1,
    completed_is_final: bool = True,
    **kw: Any,
) -> dict[str, Any]:
    """claim_transition written out again, with one of its rules changed by the arguments."""
    now: datetime.datetime = kw["now"]
    doc: dict[str, Any] = dict(record) if record is not None else {"_id": kw["key"]}
    if completed_is_final and doc.get("state") == COMPLETED:
        return doc
    if free is None:
        expires = doc.get("expires_at")
        is_free = doc.get("owner") is None or expires is None or expires <= now
    else:
        is_free = free(doc, now)
    doc["handler"], doc["event_id"], doc["checked_at"] = kw["handler_id"], kw["event_id"], now
    if is_free:
        doc["state"], doc["owner"] = LEASED, kw["owner"]
        doc["token"] = int(doc.get("token", 0)) + token_step
        doc["expires_at"] = now + datetime.timedelta(seconds=kw["lease_seconds"])
        doc["purge_at"] = doc["expires_at"] + datetime.timedelta(seconds=kw["stale_seconds"])
        doc["acquisitions"] = int(doc.get("acquisitions", 0)) + 1
        doc.setdefault("deferrals", 0)
    else:
        doc.setdefault("acquisitions", 0)
        doc["deferrals"] = int(doc.get("deferrals", 0)) + deferral_step
    return doc


def claim_ignores_expiry(record: Record | None, **kw: Any) -> Any:
    return _claim(record, free=lambda doc, now: doc.get("owner") is None, **kw)


def claim_ignores_live_lease(record: Record | None, **kw: Any) -> Any:
    return _claim(record, free=lambda doc, now: True, **kw)


def claim_expires_early(record: Record | None, **kw: Any) -> Any:
    def free(doc: dict[str, Any], now: datetime.datetime) -> bool:
        expires = doc.get("expires_at")
        return doc.get("owner") is None or expires is None or expires <= now + datetime.timedelta(seconds=1)

    return _claim(record, free=free, **kw)


def claim_keeps_token(record: Record | None, **kw: Any) -> Any:
    return _claim(record, token_step=0, **kw) if record is not None else claim_transition(record, **kw)


def claim_takes_completed(record: Record | None, **kw: Any) -> Any:
    return _claim(record, completed_is_final=False, **kw)


def claim_counts_no_deferral(record: Record | None, **kw: Any) -> Any:
    return _claim(record, deferral_step=0, **kw)


# -- fenced writes and counts -----------------------------------------------------------------------


def _as_fenced(record: Record | None, owner: str, token: int) -> Record | None:
    return None if record is None else {**record, "owner": owner, "token": token}


def _restore(after: dict[str, Any] | None, record: Record) -> dict[str, Any] | None:
    if after is not None and record is not None:
        after["owner"], after["token"] = record.get("owner"), record.get("token")
    return after


def completion_ignores_token(record: Record | None, owner: str, token: int, **kw: Any) -> Any:
    if record is not None and record.get("owner") == owner:
        return _restore(completion_transition(_as_fenced(record, owner, token), owner, token, **kw), record)
    return completion_transition(record, owner, token, **kw)


def completion_ignores_fence(record: Record | None, owner: str, token: int, **kw: Any) -> Any:
    return _restore(completion_transition(_as_fenced(record, owner, token), owner, token, **kw), record)


def renewal_ignores_fence(record: Record | None, owner: str, token: int, **kw: Any) -> Any:
    return _restore(renewal_transition(_as_fenced(record, owner, token), owner, token, **kw), record)


def release_ignores_fence(record: Record | None, owner: str, token: int, **kw: Any) -> Any:
    if record is None:
        return release_transition(record, owner, token, **kw)
    after, _ = release_transition({**record, "owner": owner, "token": token, "state": LEASED}, owner, token, **kw)
    if after is not None:
        after["token"], after["state"] = record.get("token"), record.get("state")
    return after, True


def release_counts_no_deferral(record: Record | None, owner: str, token: int, **kw: Any) -> Any:
    after, matched = release_transition(record, owner, token, **kw)
    if matched and after is not None and record is not None:
        after["deferrals"] = int(record.get("deferrals", 0))
    return after, matched


def count_adds_nothing(record: Record | None, counter: str, **kw: Any) -> Any:
    after = count_transition(record, counter, **kw)
    after[counter] = int((record or {}).get(counter) or 0)
    return after


# -- consumer-side decisions --------------------------------------------------------------------


def replays_unknown_commit(labels: Collection[str], *, in_commit: bool) -> ErrorStep:
    step = classify_error(labels, in_commit=in_commit)
    return ErrorStep.REPLAY if step is ErrorStep.RETRY_COMMIT else step


def retries_failed_commit(labels: Collection[str], *, in_commit: bool) -> ErrorStep:
    return ErrorStep.RETRY_COMMIT if in_commit else classify_error(labels, in_commit=in_commit)


def defers_transient(labels: Collection[str], *, in_commit: bool) -> ErrorStep:
    step = classify_error(labels, in_commit=in_commit)
    return ErrorStep.DEFER if step is ErrorStep.REPLAY and not in_commit else step


def replay_one_short(replays: int, budget: int) -> ErrorStep:
    return ErrorStep.REPLAY if replays < budget else ErrorStep.DEFER


def replay_one_extra(replays: int, budget: int) -> ErrorStep:
    return ErrorStep.REPLAY if replays <= budget + 1 else ErrorStep.DEFER


def replay_unbounded(replays: int, budget: int) -> ErrorStep:
    return ErrorStep.REPLAY


def others_completion_is_committed(record: Record | None, owner: str, token: int) -> Reconciled:
    found = reconcile(record, owner, token)
    return Reconciled.COMMITTED if found is Reconciled.DUPLICATE else found


def own_completion_is_duplicate(record: Record | None, owner: str, token: int) -> Reconciled:
    found = reconcile(record, owner, token)
    return Reconciled.DUPLICATE if found is Reconciled.COMMITTED else found


def own_lease_is_committed(record: Record | None, owner: str, token: int) -> Reconciled:
    if record is not None and record.get("owner") == owner and record.get("token") == token:
        return Reconciled.COMMITTED
    return reconcile(record, owner, token)


def renews_while_holding(*, holding: bool) -> bool:
    return True


def never_lost(*, matched: bool | None, unrenewed_for: float, lease_seconds: float) -> Heartbeat:
    verdict = heartbeat_verdict(matched=matched, unrenewed_for=unrenewed_for, lease_seconds=lease_seconds)
    return Heartbeat.RETRY if verdict is Heartbeat.LOST else verdict


def two_more_tries(expirations: int) -> bool:
    return may_try_again_after_expiry(expirations - 1)


# -- the claim inside the transaction (first-time copies) ----------------------------------------


def contended_as_claimed(before: Record | None) -> FirstClaim:
    got = read_first_claim(before)
    return FirstClaim.CLAIMED if got is FirstClaim.CONTENDED else got


def duplicate_as_claimed(before: Record | None) -> FirstClaim:
    got = read_first_claim(before)
    return FirstClaim.CLAIMED if got is FirstClaim.DUPLICATE else got


def contended_as_duplicate(before: Record | None) -> FirstClaim:
    got = read_first_claim(before)
    return FirstClaim.DUPLICATE if got is FirstClaim.CONTENDED else got


def first_claim_overwrites(record: Record | None, **kwargs: Any) -> dict[str, Any] | None:
    return first_claim_transition(None, **kwargs)


def first_claim_writes_a_lease(record: Record | None, **kwargs: Any) -> dict[str, Any] | None:
    doc = first_claim_transition(record, **kwargs)
    return None if doc is None else {**doc, "state": LEASED}


def constantly(answer: bool) -> Callable[..., bool]:
    """A decision that ignores its inputs and always answers ``answer``."""

    def decide(*args: object, **kwargs: object) -> bool:
        return answer

    return decide


COST_ONLY = (
    "claiming inside the transaction is safe for any copy (a record found there, or written meanwhile, sends it "
    "to the lease claim); which copies do it only changes the commands they cost"
)
OWNER_UNIQUE = (
    "owner ids are unique per claim (the inbox draws one per delivery), so the owner alone fences; "
    "the token matters only if an owner id were reused"
)
COMPLETION_FIRST = (
    "the completion is the transaction's first write and is fenced: a lost lease is found there before the "
    "handler runs, whatever the heartbeat concluded"
)


def mutant(name: str, target: str, function: Callable[..., Any], *caught_by: str, why: str = "") -> Mutant:
    return Mutant(name, tuple(caught_by), why, target=target, function=function)


def source(name: str, edits: tuple[Edit, ...], *caught_by: str, why: str = "", wire: bool = True) -> Mutant:
    return Mutant(name, tuple(caught_by), why, edits=edits, wire=wire)


MUTANTS: list[Mutant] = [
    # -- the inbox's sources, edited: the holes of docs/inbox.md reopened one by one --------------------
    source("inbox-completion-after-the-handler", COMPLETION_AFTER_THE_HANDLER, "concurrent-handlers"),
    source("inbox-claims-with-the-clients-write-concern", CLIENTS_WRITE_CONCERN, "ack-proof", "liveness", wire=False),
    source("inbox-claims-with-the-clients-write-concern-wire", CLIENTS_WRITE_CONCERN, "majority"),
    source("inbox-claim-without-maxTimeMS", UNBOUNDED_CLAIM, "waits-are-not-retries", wire=False),
    source("inbox-renewal-without-maxTimeMS", UNBOUNDED_RENEWAL, "bounded-wait"),
    source("inbox-no-count-after-a-failed-claim", NO_COUNT_AFTER_A_FAILED_CLAIM, "bounded-requeue"),
    source("inbox-no-count-for-a-first-time-deferral", NO_COUNT_FOR_A_FIRST_TIME_DEFERRAL, "bounded-requeue"),
    source("inbox-duplicate-aborts-its-read-only-transaction", DUPLICATE_ABORTS, "ack-proof"),
    source("inbox-no-expiry-check-at-the-claim", NO_CLAIM_TIME_EXPIRY_CHECK, "lifetime"),
    source("inbox-cancelled-release-deletes-the-counts", CANCELLED_RELEASE_DELETES, "lifetime", "bounded-requeue"),
    source(
        "inbox-expiry-counted-in-memory-only",
        EXPIRY_NOT_IN_THE_RECORD,
        "lifetime",
    ),
    source(
        "inbox-replays-a-cancelled-attempt",
        NO_CANCEL_CHECK,
        why="the model's handlers never ignore a cancellation, so a cancelled attempt never reaches a replay",
    ),
    # -- the record protocol and the transaction rules, replaced ------------------------------------------
    mutant("read_claim-held-as-leased", "protocol.read_claim", held_as_leased, "claim-reading"),
    mutant("read_claim-held-as-duplicate", "protocol.read_claim", held_as_duplicate, "ack-proof"),
    mutant("read_claim-completed-as-leased", "protocol.read_claim", completed_as_leased, "claim-reading"),
    mutant("claim-ignores-expiry", "protocol.claim_transition", claim_ignores_expiry, "liveness"),
    mutant("claim-ignores-live-lease", "protocol.claim_transition", claim_ignores_live_lease, "exclusive-lease"),
    mutant("claim-expires-1s-early", "protocol.claim_transition", claim_expires_early, "exclusive-lease"),
    mutant("claim-keeps-token", "protocol.claim_transition", claim_keeps_token, why=OWNER_UNIQUE),
    mutant("claim-takes-completed", "protocol.claim_transition", claim_takes_completed, "exclusive-lease"),
    mutant("claim-counts-no-deferral", "protocol.claim_transition", claim_counts_no_deferral, "bounded-requeue"),
    mutant("completion-ignores-token", "protocol.completion_transition", completion_ignores_token, why=OWNER_UNIQUE),
    mutant("completion-ignores-fence", "protocol.completion_transition", completion_ignores_fence, "fencing"),
    mutant("renewal-ignores-fence", "protocol.renewal_transition", renewal_ignores_fence, "fencing"),
    mutant("release-ignores-fence", "protocol.release_transition", release_ignores_fence, "fencing"),
    mutant("release-counts-no-deferral", "protocol.release_transition", release_counts_no_deferral, "bounded-requeue"),
    mutant("count-adds-nothing", "protocol.count_transition", count_adds_nothing, "bounded-requeue", "lifetime"),
    mutant("classify-replays-unknown-commit", "rules.classify_error", replays_unknown_commit, "reconciliation"),
    mutant("classify-retries-failed-commit", "rules.classify_error", retries_failed_commit, "replay"),
    mutant("classify-defers-transient", "rules.classify_error", defers_transient, "replay"),
    mutant("replay-one-short", "rules.next_after_replay", replay_one_short, "replay"),
    mutant("replay-one-extra", "rules.next_after_replay", replay_one_extra, "replay"),
    mutant("replay-unbounded", "rules.next_after_replay", replay_unbounded, "replay"),
    mutant("reconcile-others-as-committed", "protocol.reconcile", others_completion_is_committed, "ack-proof"),
    mutant("reconcile-own-as-duplicate", "protocol.reconcile", own_completion_is_duplicate, "reconciliation"),
    mutant("reconcile-lease-as-committed", "protocol.reconcile", own_lease_is_committed, "ack-proof"),
    mutant(
        "may_renew-while-holding",
        "protocol.may_renew",
        renews_while_holding,
        why="a renewal of a record the attempt's own transaction holds waits for that transaction (MongoDB) and "
        "runs out of its maxTimeMS; after it the fence no longer matches or the lease is as before: nothing "
        "observable changes",
    ),
    mutant("heartbeat-never-lost", "protocol.heartbeat_verdict", never_lost, why=COMPLETION_FIRST),
    mutant("lifetime-never-outlived", "protocol.outlived", constantly(False), "lifetime"),
    mutant("lifetime-two-more-tries", "protocol.may_try_again_after_expiry", two_more_tries, "lifetime"),
    mutant(
        "first-claim-contended-as-claimed",
        "first_claim.read_first_claim",
        contended_as_claimed,
        "at-most-once",
        "ack-proof",
        "concurrent-handlers",
    ),
    mutant(
        "first-claim-duplicate-as-claimed",
        "first_claim.read_first_claim",
        duplicate_as_claimed,
        "at-most-once",
        "ack-proof",
    ),
    mutant("first-claim-contended-as-duplicate", "first_claim.read_first_claim", contended_as_duplicate, "ack-proof"),
    mutant("first-claim-overwrites", "first_claim.first_claim_transition", first_claim_overwrites, "exclusive-lease"),
    mutant(
        "first-claim-writes-a-lease",
        "first_claim.first_claim_transition",
        first_claim_writes_a_lease,
        "claim-reading",
        "at-most-once",
        "fencing",
        "ack-proof",
    ),
    mutant(
        "first-claim-falls-back-on-any-error",
        "first_claim.first_claim_falls_back",
        constantly(True),
        why="an unlabelled error of the claim in the transaction then takes the lease claim instead of deferring: "
        "the claim meets the same server and defers if it fails too (a command more, not a guarantee)",
    ),
    # A transient error of the claim in the transaction is a contention, no replay (docs/inbox.md):
    # counted as one, it spends the replay budget of a delivery whose handler never failed.
    mutant("first-claim-never-falls-back", "first_claim.first_claim_falls_back", constantly(False), "replay"),
    mutant("first-claim-for-every-copy", "first_claim.claims_in_transaction", constantly(True), why=COST_ONLY),
    mutant("first-claim-never", "first_claim.claims_in_transaction", constantly(False), why=COST_ONLY),
]


@dataclass
class Found:
    """What the scenarios and the random runs found against one mutant (or another revision's inbox)."""

    by_scenario: Any = None
    by_machine: Any = None
    seconds: float = 0.0
    cells: list[str] = field(default_factory=list)

    @property
    def invariants(self) -> list[str]:
        return [v.invariant for v in (self.by_scenario, self.by_machine) if v is not None]


def hunt(machine: type[Any], examples: int, *, derandomize: bool = True) -> Found:
    """Run the scenarios, then (if they found nothing) the random machine, against ``machine``."""
    from hypothesis import Phase, settings
    from hypothesis.reporting import with_reporter
    from hypothesis.stateful import run_state_machine_as_test

    from tests.property.test_inbox_model import MODEL, SCENARIOS, first_violation, play

    budget = settings(
        MODEL,
        max_examples=examples,
        report_multiple_bugs=False,
        derandomize=derandomize,
        phases=[Phase.explicit, Phase.generate],
    )

    def scenario(case: Any) -> Callable[[], object]:
        cfg, moves, _ = scenario_parts(case)
        return lambda: play(cfg, moves, machine_class=machine)

    def random_runs() -> None:
        run_state_machine_as_test(machine, settings=budget)

    started = time.perf_counter()
    found = Found()
    with with_reporter(lambda _: None):
        found.by_scenario = first_violation([scenario(case) for case in SCENARIOS])
        if found.by_scenario is None:
            found.by_machine = first_violation([random_runs])
    found.seconds = time.perf_counter() - started
    return found


def score(examples: int, *, only: str = "") -> int:
    """Run every mutant against the scenarios and the random machine; print the table.

    Returns how many mutants scored otherwise than expected. The random runs are not shrunk
    (a mutant is only detected, not minimised) and are derandomised, so the table is stable.
    """
    unexpected = 0
    caught = 0
    print(f"{'mutant':52} {'scenarios':22} {f'{examples} random runs':22} {'seconds':>7}  expected")
    chosen = [m for m in MUTANTS if only in m.name]
    for item in chosen:
        with item.applied() as machine:
            found = hunt(machine, examples)
        invariants = found.invariants
        caught += bool(invariants)
        unexpected += not (set(invariants) <= set(item.caught_by)) or (bool(invariants) == item.equivalent)
        cells = [v.invariant if v is not None else "-" for v in (found.by_scenario, found.by_machine)]
        if found.by_scenario is not None:
            cells[1] = "(not run)"
        print(
            f"{item.name:52} {cells[0]:22} {cells[1]:22} {found.seconds:7.1f}  "
            f"{'/'.join(item.caught_by) or 'equivalent'}"
        )
    live = sum(not m.equivalent for m in chosen)
    print(f"mutation score: {caught} caught of {live} non-equivalent mutants ({len(chosen) - live} equivalent)")
    return unexpected


def against(path: Path, examples: int) -> int:
    """Run the scenarios, then the random machine, against another revision's ``lily_mongo/_inbox/`` folder.

    The wire checks are off, and an ACK of a completion that is not yet majority-committed is
    let through, so each scenario shows what its hole leads to (the drain's liveness check
    reports an event ACKed and then rolled back as lost).
    """
    from tests.property.test_inbox_model import InboxModel

    with other_inbox(path) as module:
        machine = type("OtherInbox", (InboxModel,), {"INBOX": module, "CHECK_WIRE": False, "CHECK_ACK_MAJORITY": False})
        return _play_all(machine, examples)


def scenario_parts(case: Any) -> tuple[Config, list[Move], str]:
    """A scenario's configuration, its moves and the trace line it reaches (a ``SCENARIOS`` pytest param)."""
    cfg, moves, reaches = case.values
    return cfg, moves, reaches


def _play_all(machine: type[Any], examples: int) -> int:
    from tests.property.test_inbox_model import SCENARIOS, play

    failures = 0
    for case in SCENARIOS:
        try:
            cfg, moves, reaches = scenario_parts(case)
            machine_run = play(cfg, moves, machine_class=machine)
            reached = any(reaches in line for line in machine_run.trace)
            print(f"{case.id:52} passes{'' if reached else ' (without reaching its end)'}")
        except Exception as exc:
            failures += 1
            first = str(exc).splitlines()[0]
            print(f"{case.id:52} FAILS {first[:200]}")
    found = hunt(machine, examples)
    violation = found.by_machine or found.by_scenario
    print(f"{examples} random runs: {violation.invariant if violation else 'nothing found'}")
    return failures


if __name__ == "__main__":
    logging.getLogger("lily_mongo").disabled = True  # the inbox's warnings about failed releases, by the thousand
    arguments = sys.argv[1:]
    if arguments[:1] == ["--source"]:
        sys.exit(1 if against(Path(arguments[1]), int(arguments[2]) if len(arguments) > 2 else 100) else 0)
    examples = int(arguments[0]) if arguments else 250
    sys.exit(1 if score(examples, only=arguments[1] if len(arguments) > 1 else "") else 0)
