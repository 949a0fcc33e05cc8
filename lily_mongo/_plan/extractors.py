"""Handler parameters: what a handler can ask for, resolved once at plan time.

A handler declares what it needs through annotations::

    async def on_order(order: Json[Order], event_id: EventId, mongo: MongoScope) -> None

``Json[T]``, ``Text`` and ``Bytes`` are *terminal* extractors: they decode the
body, and a handler has at most one. The rest read bounded metadata. An
application adds its own with ``Annotated[T, MyExtractor()]`` where
``MyExtractor`` subclasses :class:`Extractor`.

Beyond the delivery, a handler may ask for what the consumer supplies per
attempt (docs/handlers.md): ``MongoDatabase`` (the consumer's database, for every
guarantee), resources and dependencies (:mod:`.parameters`, which resolves every
parameter once, at plan time).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import orjson
import pydantic

from .._errors import ErrorCode, PlanError
from .._fast import slot_constructor

if TYPE_CHECKING:
    from ..envelope import Envelope

__all__ = [
    "Bytes",
    "EventId",
    "Extractor",
    "Json",
    "RawDelivery",
    "Redelivered",
    "RetryCount",
    "Text",
]

T = TypeVar("T")


NOT_DECODED: Any = object()
"""Marks a payload that has not been decoded yet (the handler's extractor decodes it)."""


class PayloadDecodeError(Exception):
    """A terminal extractor could not decode the body (mapped to QUEUE_PAYLOAD_DECODE_FAILED)."""

    code: ErrorCode = ErrorCode.PAYLOAD_DECODE_FAILED


class PayloadInvalidError(PayloadDecodeError):
    """The body decoded, but the payload's model refused it (mapped to QUEUE_PAYLOAD_INVALID)."""

    code = ErrorCode.PAYLOAD_INVALID


@dataclass(frozen=True, slots=True)
class RawDelivery:
    """A read-only view of one delivery: metadata and body, never a channel or an ACK handle."""

    queue: str
    headers: Mapping[str, Any]
    body: bytes
    content_type: str | None
    redelivered: bool
    envelope: Envelope
    routing_key: str
    exchange: str

    def __repr__(self) -> str:
        return f"<RawDelivery queue={self.queue!r} body={len(self.body)} bytes>"


new_raw_delivery = slot_constructor(RawDelivery)
"""``RawDelivery(...)`` for the per-delivery path, positional (see _fast.py for why)."""


class Extractor:
    """Base class for parameter extractors; subclass it for application extractors.

    Set ``terminal = True`` when the extractor decodes the body: its failures
    become permanent ``QUEUE_PAYLOAD_DECODE_FAILED`` rejections.
    """

    terminal: bool = False

    def bind(self, annotation: Any) -> Extractor:
        """Called once at plan time with the parameter's base type; return the bound extractor."""
        return self

    def extract(self, delivery: RawDelivery) -> Any:
        """Produce the argument for one delivery."""
        raise NotImplementedError

    def payload_schema(self, ref_template: str) -> dict[str, Any]:
        """JSON Schema of the body a terminal extractor accepts (for the AsyncAPI document)."""
        return {}


class _JsonExtractor(Extractor):
    terminal = True

    def __init__(self, adapter: pydantic.TypeAdapter[Any] | None = None) -> None:
        self._adapter = adapter

    def bind(self, annotation: Any) -> Extractor:
        try:
            return _JsonExtractor(pydantic.TypeAdapter(annotation))
        except pydantic.PydanticSchemaGenerationError as exc:
            raise PlanError(f"Json[{annotation!r}] has no pydantic schema: {exc}") from exc

    def payload_schema(self, ref_template: str) -> dict[str, Any]:
        assert self._adapter is not None
        schema: dict[str, Any] = self._adapter.json_schema(ref_template=ref_template)
        return schema

    def extract(self, delivery: RawDelivery) -> Any:
        assert self._adapter is not None
        try:
            return self._adapter.validate_python(orjson.loads(delivery.body))
        except orjson.JSONDecodeError as exc:
            raise PayloadDecodeError(f"body is not valid JSON: {exc.msg} at position {exc.pos}") from None
        except pydantic.ValidationError as exc:
            first = exc.errors(include_url=False, include_input=False)[:3]
            where = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in first)
            raise PayloadInvalidError(f"{exc.error_count()} validation error(s): {where}") from None


class _TextExtractor(Extractor):
    terminal = True

    def payload_schema(self, ref_template: str) -> dict[str, Any]:
        return {"type": "string"}

    def extract(self, delivery: RawDelivery) -> str:
        try:
            return delivery.body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PayloadDecodeError(f"body is not UTF-8 (byte {exc.start})") from None


class _BytesExtractor(Extractor):
    terminal = True

    def payload_schema(self, ref_template: str) -> dict[str, Any]:
        return {"type": "string", "format": "binary"}

    def extract(self, delivery: RawDelivery) -> bytes:
        return delivery.body


class _EventIdExtractor(Extractor):
    def extract(self, delivery: RawDelivery) -> uuid.UUID:
        return delivery.envelope.event_id


class _RetryCountExtractor(Extractor):
    def extract(self, delivery: RawDelivery) -> int:
        return delivery.envelope.retry_count


class _RedeliveredExtractor(Extractor):
    def extract(self, delivery: RawDelivery) -> bool:
        return delivery.redelivered


class RawDeliveryExtractor(Extractor):
    def extract(self, delivery: RawDelivery) -> RawDelivery:
        return delivery


Json = Annotated[T, _JsonExtractor()]
"""``Json[Model]``: the body decoded with orjson and validated by pydantic."""
Text = Annotated[str, _TextExtractor()]
"""The body decoded as UTF-8."""
Bytes = Annotated[bytes, _BytesExtractor()]
"""The raw body."""
EventId = Annotated[uuid.UUID, _EventIdExtractor()]
"""The event id (preserved across retries, DLQ and replays)."""
RetryCount = Annotated[int, _RetryCountExtractor()]
"""The framework's application retry count (``x-retry-count``)."""
Redelivered = Annotated[bool, _RedeliveredExtractor()]
"""The broker's ``redelivered`` flag: says nothing about an earlier commit."""


class MongoDatabaseMark:
    """Marks the ``MongoDatabase`` parameter: the consumer's database, supplied per attempt."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "MongoDatabase"
