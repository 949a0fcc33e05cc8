"""A transaction's outgoing messages: one record inserted per message, born claimed by the dispatcher
(docs/outbox.md)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, cast

import bson

from .._clock import Clock, utcnow
from .._errors import ConfigError, ScopeClosedError
from .._observer import NO_OBSERVER, Observer
from ..publisher import CustomPublishContent, PublishOptions, TypedPublishing, prepare_publication
from . import protocol
from .protocol import Claim

# MongoDB's document limit, less what the relay's claim and marks add to a record later (owner,
# token, times, a failure reason of at most 512 bytes): a record that fits now fits them too, so
# none fails its batch's claim (docs/outbox.md, "Failure classes").
MAX_RECORD_BYTES: Final = 16 * 1024 * 1024 - 4 * 1024
# Below this body size a record cannot come near the limit (the headers are bounded to 32 KiB):
# only larger ones are encoded to be measured.
_MEASURED_FROM: Final = MAX_RECORD_BYTES - 64 * 1024

if TYPE_CHECKING:
    from pymongo.asynchronous.client_session import AsyncClientSession
    from pymongo.asynchronous.collection import AsyncCollection

# -- the writer -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WriterSettings:
    """What the writers of one process's transactions share: the record collection, the body bound, the
    observer, the (server-corrected) clock records are written at, and the dispatcher's claim, if any."""

    collection: AsyncCollection[Any]
    max_body: int
    observer: Observer = NO_OBSERVER
    clock: Clock = utcnow
    claim: Callable[[], Claim | None] | None = None


class OutboxWriter(TypedPublishing):
    """The outgoing messages of one transaction, inserted in it; valid while its scope is open.

    A handler gets it as ``mongo.outbox``; :class:`OutboxTransaction` wraps one. ``records``
    are the documents inserted, in write order, for the dispatcher once committed.
    """

    __slots__ = ("_is_open", "_next_seq", "_session", "_settings", "_writer", "_written_at", "claim", "records")

    def __init__(
        self, settings: WriterSettings, session: AsyncClientSession, *, writer: str, is_open: Callable[[], bool]
    ) -> None:
        self._settings = settings
        self._session = session
        self._writer = writer
        self._is_open = is_open
        self._written_at = protocol.EPOCH
        self._next_seq = 0  # taken before the insert's await: concurrent publishes get distinct positions
        self.claim: Claim | None = None
        self.records: list[dict[str, Any]] = []

    def __repr__(self) -> str:
        return f"<OutboxWriter written={len(self.records)} open={self._is_open()}>"

    @property
    def written(self) -> int:
        """How many records this transaction wrote."""
        return len(self.records)

    async def _publish[T](
        self, content: CustomPublishContent[T], routing_key: str, payload: T, version: int, options: PublishOptions
    ) -> uuid.UUID:
        if not self._is_open():
            raise ScopeClosedError("the outbox of a finished transaction cannot be used")
        settings = self._settings
        settings.observer.outbox_record(cast("dict[str, Any]", options))  # it may add the trace context
        publication = prepare_publication(
            content, routing_key, payload, version=version, max_body=settings.max_body, **options
        )
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        if seq == 0:
            # One time and one claim per transaction: its records sort together, in write order.
            self._written_at = settings.clock()
            self.claim = settings.claim() if settings.claim is not None else None
        record = protocol.new_record(
            record_id=uuid.uuid4().hex,
            event_id=str(publication.event_id),
            exchange=publication.exchange,
            routing_key=publication.routing_key,
            body=publication.body,
            headers=publication.headers,
            content_type=publication.content_type,
            writer=self._writer,
            written_at=self._written_at,
            seq=seq,
            claim=self.claim,
        )
        if len(publication.body) > _MEASURED_FROM and (size := len(bson.encode(record))) > MAX_RECORD_BYTES:
            raise ConfigError(
                f"an outbox record of {size} bytes (body {len(publication.body)} bytes) exceeds {MAX_RECORD_BYTES} "
                "bytes: MongoDB's 16 MiB document limit less 4 KiB for the relay's claim and marks"
            )
        await settings.collection.insert_one(record, session=self._session)
        self.records.append(record)
        if len(self.records) > 1 and self.records[-2]["seq"] > seq:  # concurrent publishes finished out of order
            self.records.sort(key=lambda r: r["seq"])
        return publication.event_id
