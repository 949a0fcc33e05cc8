"""What the engine reports, at a few named points: the one interface telemetry implements.

The engine (runtime, inbox, outbox, publisher, lifecycle) calls an :class:`Observer`
at these points and never asks whether telemetry is on:

* a delivery started (:meth:`Observer.delivery_started`), which returns the
  delivery's own :class:`DeliveryObserver`: its execution done, its hand-off
  publish, its terminal outcome, and leaving its task;
* the inbox steps: the lease claim, each attempt, the commit, a reconciliation;
* an outbox record about to be written, and its publish (by the dispatcher after
  the commit, or by the backstop relay);
* a :class:`~lily_mongo.Publisher` publish;
* a consumer's snapshot, read by observable metrics when collected.

A step is passed as the awaitable that performs it: the observer returns it
unchanged or awaits it inside a span. :data:`NO_OBSERVER`, used when telemetry
is off, returns every step unchanged and records nothing; each point then costs
one call of an empty method (docs/observability.md).
:class:`lily_mongo.telemetry.Telemetry` is the OpenTelemetry implementation.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from ._snapshots import Snapshot
    from ._verdicts import Execution, PipelineResult

__all__ = ["NO_DELIVERY", "NO_OBSERVER", "ClaimAnswer", "DeliveryObserver", "Observer", "PublishWith", "SnapshotSource"]

PublishWith = Callable[[dict[str, Any]], Awaitable[None]]
"""``send(headers)``: publish with this header table (the observer may add its trace context)."""

C = TypeVar("C", bound="ClaimAnswer")
T = TypeVar("T")


class ClaimAnswer(Protocol):
    """What a lease claim concluded (the inbox protocol's ``Claim``): its kind, the event's deferrals so far."""

    @property
    def kind(self) -> enum.Enum: ...
    @property
    def deferrals(self) -> int: ...


SnapshotSource = Callable[[], "tuple[Snapshot, tuple[str, ...]]"]
"""Returns a consumer's snapshot and its queue names in plan order (``QueueSnapshot.queue_index``)."""


class DeliveryObserver(Protocol):
    """One delivery's observer, from :meth:`Observer.delivery_started` to :meth:`finish`."""

    def executed(self, started: float) -> None:
        """The execution, started at ``time.monotonic()`` value ``started``, returned its verdict."""
        ...

    def handoff(
        self, send: PublishWith, routing_key: str, headers: dict[str, Any], *, dead_letter: bool, code: str | None
    ) -> Awaitable[None]:
        """The delivery's retry or DLQ copy, published through ``send``."""
        ...

    def finish(
        self, handler_id: str | None, event_id: object, outcome: str, code: str | None, execution: Execution
    ) -> None:
        """The delivery reached its terminal outcome (called once, possibly from another task)."""
        ...

    def detach(self) -> None:
        """The delivery's own task is done with it (restores what was current before it)."""
        ...


class Observer(Protocol):
    """The engine's named reporting points; see the module docstring."""

    def delivery_started(self, queue: str, headers: Mapping[str, Any]) -> DeliveryObserver: ...

    def inbox_claim(self, claim: Awaitable[C]) -> Awaitable[C]:
        """The lease claim, answering what it concluded."""
        ...

    def inbox_attempt(
        self, attempt: Awaitable[PipelineResult], number: int, replays: int, *, first: bool
    ) -> Awaitable[PipelineResult]:
        """Attempt ``number`` (from 1) after ``replays`` replays; ``first``: it claims in its transaction."""
        ...

    def inbox_commit(self, commit: Awaitable[PipelineResult]) -> Awaitable[PipelineResult]: ...

    def batch(self, run: Awaitable[T], queue: str, size: int, deliveries: Sequence[DeliveryObserver]) -> Awaitable[T]:
        """One batch of a batch handler, ``size`` deliveries of ``queue`` (their observers), run by ``run``."""
        ...

    def inbox_reconcile(self, reconcile: Awaitable[PipelineResult]) -> Awaitable[PipelineResult]: ...

    def outbox_record(self, options: MutableMapping[str, Any]) -> None:
        """An outbox record is about to be written with these publish options (the observer may add
        the current trace context, which the relay's publish continues)."""
        ...

    def relay_publish(self, send: PublishWith, record: Mapping[str, Any], *, via: str = "relay") -> Awaitable[None]:
        """An outbox ``record`` is published (its message, with the ``headers`` it stored): ``via`` is
        ``"dispatch"`` (right after its commit, from memory) or ``"relay"`` (the backstop relay)."""
        ...

    def publish(
        self, send: PublishWith, *, exchange: str, routing_key: str, headers: dict[str, Any], event_id: object
    ) -> Awaitable[None]:
        """A :class:`~lily_mongo.Publisher` publish of event ``event_id``."""
        ...

    def watch(self, source: SnapshotSource) -> Callable[[], None]:
        """Read ``source`` when metrics are collected; returns the function that stops it."""
        ...


def _nothing() -> None:
    return None


class _NoDelivery:
    __slots__ = ()

    def executed(self, started: float) -> None:
        pass

    def handoff(
        self, send: PublishWith, routing_key: str, headers: dict[str, Any], *, dead_letter: bool, code: str | None
    ) -> Awaitable[None]:
        return send(headers)

    def finish(
        self, handler_id: str | None, event_id: object, outcome: str, code: str | None, execution: Execution
    ) -> None:
        pass

    def detach(self) -> None:
        pass


class _NoObserver:
    """Telemetry off: every step is returned unchanged, nothing is recorded."""

    __slots__ = ()

    def delivery_started(self, queue: str, headers: Mapping[str, Any]) -> DeliveryObserver:
        return NO_DELIVERY

    def inbox_claim(self, claim: Awaitable[C]) -> Awaitable[C]:
        return claim

    def inbox_attempt(
        self, attempt: Awaitable[PipelineResult], number: int, replays: int, *, first: bool
    ) -> Awaitable[PipelineResult]:
        return attempt

    def inbox_commit(self, commit: Awaitable[PipelineResult]) -> Awaitable[PipelineResult]:
        return commit

    def batch(self, run: Awaitable[T], queue: str, size: int, deliveries: Sequence[DeliveryObserver]) -> Awaitable[T]:
        return run

    def inbox_reconcile(self, reconcile: Awaitable[PipelineResult]) -> Awaitable[PipelineResult]:
        return reconcile

    def outbox_record(self, options: MutableMapping[str, Any]) -> None:
        pass

    def relay_publish(self, send: PublishWith, record: Mapping[str, Any], *, via: str = "relay") -> Awaitable[None]:
        return send(record["headers"])

    def publish(
        self, send: PublishWith, *, exchange: str, routing_key: str, headers: dict[str, Any], event_id: object
    ) -> Awaitable[None]:
        return send(headers)

    def watch(self, source: SnapshotSource) -> Callable[[], None]:
        return _nothing


NO_DELIVERY: DeliveryObserver = _NoDelivery()
NO_OBSERVER: Observer = _NoObserver()
