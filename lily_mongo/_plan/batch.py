"""Batch handlers (docs/handlers.md, "Batch handlers"): many events per call, each settled on its own.

``@queue(..., batch=BatchOptions(max_size=100, max_wait=0.05))`` on a handler whose body parameter
is ``Batch[Json[T]]`` (or ``Batch[Text]``, ``Batch[Bytes]``, a terminal extractor) makes it a batch
handler: the engine forms batches of the queue's deliveries that passed envelope validation and
decoding, and calls the handler once per batch with a :class:`Batch` of :class:`BatchEntry` values.
Each entry keeps its own event id, retry count and inbox record, and ends on its own: committed,
duplicate, retried or dead-lettered (:meth:`Batch.fail`, :class:`BatchItemFailed`).

Pure: the options, the handler's view of a batch, and the plan's rules for batch handlers.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload

from .._checks import check_int, check_seconds
from .._errors import ConfigError, PlanError
from ..bounds import BOUNDS
from .extractors import Extractor, RawDelivery
from .options import QueueOptions

__all__ = [
    "Batch",
    "BatchEntry",
    "BatchExtractor",
    "BatchItemFailed",
    "BatchOptions",
    "batch_permits",
    "check_batch_queue",
    "default_batch_prefetch",
]

T = TypeVar("T")

_MAX_WAIT_SECONDS = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchOptions:
    """How a batch handler's batches are formed (docs/configuration.md, "BatchOptions").

    A batch is dispatched once it holds ``max_size`` deliveries, or ``max_wait`` seconds after its
    first delivery, whichever comes first. The queue's ``prefetch`` must let a batch fill: at
    least ``max_size`` (the plan refuses less); ``(concurrency + 1) * max_size`` keeps every running
    batch full while the next one forms.
    """

    max_size: int = 100
    max_wait: float = 0.05

    def __post_init__(self) -> None:
        check_int("BatchOptions.max_size", self.max_size, 1, BOUNDS.prefetch_max)
        check_seconds("BatchOptions.max_wait", self.max_wait, low=0.0, high=_MAX_WAIT_SECONDS, low_inclusive=False)
        object.__setattr__(self, "max_wait", float(self.max_wait))


@dataclass(frozen=True, slots=True, eq=False)
class BatchEntry[T]:
    """One event of a batch: its id, its retry count, its decoded body and its read-only delivery."""

    event_id: uuid.UUID
    retry_count: int
    body: T
    delivery: RawDelivery

    @property
    def redelivered(self) -> bool:
        return self.delivery.redelivered

    def __repr__(self) -> str:
        return f"<BatchEntry event_id={self.event_id} retry_count={self.retry_count}>"


class BatchItemFailed(Exception):
    """Raised by a batch handler: ``entry`` failed with ``error``; the batch runs again without it.

    The transaction is aborted, ``entry`` goes to its retry bucket or its DLQ with ``error``'s
    verdict (a :class:`~lily_mongo.QueueHandlerError`, or any exception: ``QUEUE_HANDLER_FAILED``),
    and the other entries run again in a fresh transaction.
    """

    def __init__(self, entry: BatchEntry[Any], error: BaseException) -> None:
        super().__init__(f"batch entry {entry.event_id} failed: {type(error).__name__}: {error}")
        self.entry = entry
        self.error = error


class Batch(Sequence[BatchEntry[T]]):
    """The handler's view of one batch: a sequence of :class:`BatchEntry`, and :meth:`fail`.

    Annotate the handler's body parameter ``Batch[Json[T]]`` (or ``Batch[Text]``, ``Batch[Bytes]``):
    each entry's ``body`` is its delivery's body decoded as the inner extractor decodes it. Valid
    for one call: an entry failed with :meth:`fail` is not committed, whatever the handler wrote.
    """

    __slots__ = ("_entries", "failures")

    def __init__(self, entries: Sequence[BatchEntry[T]]) -> None:
        self._entries = tuple(entries)
        self.failures: dict[int, BaseException] = {}  # by id() of the entry: what fail() recorded

    @overload
    def __getitem__(self, index: int) -> BatchEntry[T]: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[BatchEntry[T]]: ...
    def __getitem__(self, index: int | slice) -> BatchEntry[T] | Sequence[BatchEntry[T]]:
        return self._entries[index]

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[BatchEntry[T]]:
        return iter(self._entries)

    def __repr__(self) -> str:
        return f"<Batch of {len(self._entries)} entries, {len(self.failures)} failed>"

    @property
    def bodies(self) -> list[T]:
        """Every entry's body, in order."""
        return [entry.body for entry in self._entries]

    def fail(self, entry: BatchEntry[T], error: BaseException) -> None:
        """Fail ``entry`` alone: the others commit; it goes to its retry bucket or its DLQ with ``error``'s
        verdict (a :class:`~lily_mongo.QueueHandlerError`'s code, or ``QUEUE_HANDLER_FAILED``)."""
        if not any(e is entry for e in self._entries):
            raise ValueError(f"{entry!r} is not an entry of this batch")
        if not isinstance(error, BaseException):
            raise TypeError(f"Batch.fail needs an exception (a QueueHandlerError), got {type(error).__name__}")
        self.failures[id(entry)] = error

    def failure_of(self, entry: BatchEntry[T]) -> BaseException | None:
        """What :meth:`fail` recorded for ``entry`` (None: not failed)."""
        return self.failures.get(id(entry))


class BatchExtractor(Extractor):
    """The ``Batch[...]`` parameter: terminal; each delivery's body is decoded by ``inner`` while preparing,
    and the handler gets the :class:`Batch` of them (the engine passes it as the attempt's payload)."""

    terminal = True

    def __init__(self, inner: Extractor) -> None:
        self.inner = inner

    def extract(self, delivery: RawDelivery) -> Any:
        return self.inner.extract(delivery)  # one delivery's body: what its entry carries

    def payload_schema(self, ref_template: str) -> dict[str, Any]:
        return self.inner.payload_schema(ref_template)

    def __repr__(self) -> str:
        return f"Batch[{type(self.inner).__name__}]"


def default_batch_prefetch(batch: BatchOptions) -> int:
    """The prefetch of a batch handler's queue that is not configured: two batches' worth (one running,
    one forming), at least the default of 64, within the bound."""
    return min(max(QueueOptions(name="q").prefetch, 2 * batch.max_size), BOUNDS.prefetch_max)


def check_batch_queue(options: QueueOptions, batch: BatchOptions, where: str) -> None:
    """Refuse a queue on which a batch could never fill (docs/configuration.md, "BatchOptions")."""
    prefetch = options.effective_prefetch
    if prefetch < batch.max_size:
        raise PlanError(
            f"{where}: a batch of BatchOptions.max_size {batch.max_size} could never fill on queue "
            f"{options.name!r:.60}: its prefetch is {prefetch} (min(prefetch {options.prefetch}, concurrency "
            f"{options.concurrency} + buffer {options.buffer})), which must be at least max_size; "
            f"configure_queue(..., prefetch={min((options.concurrency + 1) * batch.max_size, BOUNDS.prefetch_max)}) "
            "keeps every batch full"
        )


def batch_permits(options: QueueOptions, batch: BatchOptions) -> int:
    """Deliveries of a batch queue held at once: ``concurrency`` running batches and one forming."""
    return (options.concurrency + 1) * batch.max_size


def check_batch_options(value: object) -> BatchOptions | None:
    if value is not None and not isinstance(value, BatchOptions):
        raise ConfigError(f"batch must be a BatchOptions, got {type(value).__name__}")
    return value
