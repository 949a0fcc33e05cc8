"""The typed publisher (docs/contracts.md section 8): MIME and every Lily header written together.

Every publish is mandatory on a channel with publisher confirms; an unroutable,
nacked or unconfirmed publish raises :class:`PublishError`. The same
:func:`prepare_publication` builds what the outbox stores, so a message looks
the same whether it was published directly or relayed.
"""

from __future__ import annotations

import enum
import functools
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self, TypedDict, TypeVar, Unpack

import aio_pika
import aio_pika.abc

from ._amqp import basic_publish, connect_amqp
from ._checks import check_amqp_url, check_seconds
from ._errors import ConfigError, EnvelopeError, LilyError
from ._headers import (
    CONTENT_KIND_HEADER,
    EVENT_ID_HEADER,
    RETRY_COUNT_HEADER,
    SCHEMA_VERSION_HEADER,
    TRACEPARENT_HEADER,
    TRACESTATE_HEADER,
)
from ._observer import NO_OBSERVER, Observer
from ._plan.options import check_name
from ._text import describe_value
from .bounds import BOUNDS
from .content import BINARY, JSON, TEXT, CustomPublishContent, encode_json
from .envelope import is_canonical_uuid, validate_envelope
from .telemetry import resolve_telemetry

if TYPE_CHECKING:
    from .telemetry import Telemetry

__all__ = [
    "BINARY",
    "JSON",
    "TEXT",
    "CustomPublishContent",
    "OpenClose",
    "Publication",
    "PublishOptions",
    "Publisher",
    "TypedPublishing",
    "encode_json",
    "prepare_publication",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Publication:
    """One fully prepared message: where it goes, its body and its canonical headers."""

    exchange: str
    routing_key: str
    body: bytes
    headers: dict[str, Any]
    content_type: str
    event_id: uuid.UUID


class PublishOptions(TypedDict, total=False):
    """The keyword options of every publish method (``publish_json`` and friends, ``Outbox.publish``)."""

    exchange: str
    """The exchange; ``""`` (the default exchange) routes by queue name."""
    event_id: uuid.UUID | str | None
    """The event id to carry (canonical UUID text or a UUID); a fresh UUID4 when absent."""
    headers: Mapping[str, Any] | None
    """Application headers; ``x-lily-*`` and ``x-retry-count`` are reserved."""
    retry_count: int | None
    """``x-retry-count`` to write (0..100); normally left out."""
    traceparent: str | None
    """W3C ``traceparent`` (at most 55 bytes)."""
    tracestate: str | None
    """W3C ``tracestate`` (at most 512 bytes)."""


def prepare_publication[T](
    content: CustomPublishContent[T],
    routing_key: str,
    payload: T,
    *,
    version: int,
    exchange: str = "",
    event_id: uuid.UUID | str | None = None,
    headers: Mapping[str, Any] | None = None,
    retry_count: int | None = None,
    traceparent: str | None = None,
    tracestate: str | None = None,
    max_body: int = BOUNDS.queue_body_max,
) -> Publication:
    """Encode ``payload`` and build the canonical headers; raise :class:`ConfigError` on bad input.

    The result is validated with the same :func:`validate_envelope` a consumer
    runs, so nothing is published that a Lily consumer would reject.
    """
    # The empty name is the default exchange, and an empty routing key is valid AMQP.
    if routing_key != "":
        check_name("routing_key", routing_key)
    if exchange != "":
        check_name("exchange", exchange)
    if (
        isinstance(version, bool)
        or not isinstance(version, int)
        or not (BOUNDS.schema_version_min <= version <= BOUNDS.schema_version_max)
    ):
        raise ConfigError(
            f"version must be an integer {BOUNDS.schema_version_min}..{BOUNDS.schema_version_max}, "
            f"got {describe_value(version)}"
        )
    event = _event_id(event_id)
    body = content.encode(payload)
    if not isinstance(body, bytes):
        raise ConfigError(f"encoder for content kind {content.kind!r} returned {type(body).__name__}, not bytes")
    table = _own_headers(headers)
    table[EVENT_ID_HEADER] = str(event)
    table[SCHEMA_VERSION_HEADER] = str(version)
    table[CONTENT_KIND_HEADER] = content.kind
    if retry_count is not None:
        table[RETRY_COUNT_HEADER] = retry_count
    if traceparent is not None:
        table[TRACEPARENT_HEADER] = traceparent
    if tracestate is not None:
        table[TRACESTATE_HEADER] = tracestate
    try:
        validate_envelope(table, len(body), max_body=max_body)
    except EnvelopeError as exc:
        raise ConfigError(f"message would be rejected by consumers: {exc.code}: {exc.reason}") from exc
    return Publication(exchange, routing_key, body, table, content.content_type, event)


def _event_id(event_id: uuid.UUID | str | None) -> uuid.UUID:
    """The event id a publish gives (a new one when None), never the nil UUID."""
    if event_id is None:
        return uuid.uuid4()
    if isinstance(event_id, uuid.UUID):
        event = event_id
    elif is_canonical_uuid(event_id):
        event = uuid.UUID(event_id)
    else:
        raise ConfigError(f"event_id must be a UUID or canonical UUID text, got {describe_value(event_id)}")
    if event.int == 0:
        raise ConfigError("event_id must not be the nil UUID")
    return event


def _own_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """The caller's headers, none of them one the framework writes itself."""
    table: dict[str, Any] = {}
    if headers:
        for key in headers:
            if key.startswith("x-lily-") or key == RETRY_COUNT_HEADER:
                raise ConfigError(f"headers may not set the reserved header {key!r}; use the keyword arguments")
        table.update(headers)
    return table


class TypedPublishing:
    """``publish`` and ``publish_json`` / ``publish_text`` / ``publish_binary`` on top of a ``_publish`` method.

    Shared by :class:`Publisher` (publishes now) and the outbox (stages for the relay): the
    signatures are written here once, and each subclass says in ``_publish`` what a publish does.
    """

    __slots__ = ()

    async def publish[T](
        self,
        content: CustomPublishContent[T],
        routing_key: str,
        payload: T,
        *,
        version: int,
        **options: Unpack[PublishOptions],
    ) -> uuid.UUID:
        """Publish ``payload`` with a custom content contract (an outbox stages it: it is published after the
        commit); return its event id."""
        return await self._publish(content, routing_key, payload, version, options)

    async def publish_json(
        self, routing_key: str, payload: Any, *, version: int, **options: Unpack[PublishOptions]
    ) -> uuid.UUID:
        """A JSON payload (content kind ``json``, ``application/json``); pydantic models are dumped."""
        return await self._publish(JSON, routing_key, payload, version, options)

    async def publish_text(
        self, routing_key: str, payload: str, *, version: int, **options: Unpack[PublishOptions]
    ) -> uuid.UUID:
        """UTF-8 text (content kind ``text``, ``text/plain; charset=utf-8``)."""
        return await self._publish(TEXT, routing_key, payload, version, options)

    async def publish_binary(
        self, routing_key: str, payload: bytes, *, version: int, **options: Unpack[PublishOptions]
    ) -> uuid.UUID:
        """Raw bytes (content kind ``binary``, ``application/octet-stream``)."""
        return await self._publish(BINARY, routing_key, payload, version, options)

    async def _publish[T](
        self, content: CustomPublishContent[T], routing_key: str, payload: T, version: int, options: PublishOptions
    ) -> uuid.UUID:
        """What one publish does: publish now, or stage in the transaction; returns the event id."""
        raise NotImplementedError


class ResourceState(enum.Enum):
    """Where an :class:`OpenClose` resource is: a closed one is never opened again."""

    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


class OpenClose:
    """``async with`` on top of ``open()`` and ``close()``: opened on the way in, closed on the way out.

    Shared by :class:`Publisher` and the standalone outbox, whose state is a :class:`ResourceState`.
    """

    async def open(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class Publisher(OpenClose, TypedPublishing):
    """Publishes typed messages with confirms; an async context manager.

    Either give ``amqp_url`` (the publisher owns its connection) or an open
    aio-pika ``channel`` created with ``publisher_confirms=True`` (caller-owned).
    With ``telemetry`` on (the default when ``opentelemetry-api`` is installed) each
    publish is a ``PRODUCER`` span whose ``traceparent`` the message carries.
    """

    def __init__(
        self,
        amqp_url: str | Sequence[str] | None = None,
        *,
        channel: aio_pika.abc.AbstractChannel | None = None,
        confirm_timeout: float = 10.0,
        telemetry: bool | Telemetry = True,
    ) -> None:
        if (amqp_url is None) == (channel is None):
            raise ConfigError("Publisher needs exactly one of amqp_url or channel")
        if amqp_url is not None:
            amqp_url = check_amqp_url("amqp_url", amqp_url)
        if channel is not None and not isinstance(channel, aio_pika.abc.AbstractChannel):
            raise ConfigError(f"channel must be an aio-pika channel, got {describe_value(channel)}")
        confirm_timeout = check_seconds("confirm_timeout", confirm_timeout, low=0, high=3600, low_inclusive=False)
        self._url = amqp_url
        self._channel = channel
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._confirm_timeout = confirm_timeout
        self._observer: Observer = resolve_telemetry(telemetry) or NO_OBSERVER
        self._state = ResourceState.OPEN if channel is not None else ResourceState.NEW

    def __repr__(self) -> str:
        return f"<Publisher state={self._state.value}>"

    async def open(self) -> None:
        """Connect (when built from a URL) and open a confirming channel."""
        if self._state is ResourceState.CLOSED:
            raise LilyError("Publisher is closed and cannot be reopened")
        if self._state is ResourceState.OPEN:
            return
        assert self._url is not None
        self._connection = await connect_amqp(self._url)
        try:
            self._channel = await self._connection.channel(publisher_confirms=True, on_return_raises=True)
        except BaseException:
            await self._connection.close()
            raise
        self._state = ResourceState.OPEN

    async def close(self) -> None:
        """Close the connection if this publisher owns it; idempotent."""
        self._state = ResourceState.CLOSED
        if self._connection is not None:
            connection, self._connection = self._connection, None
            await connection.close()

    async def send(self, publication: Publication) -> uuid.UUID:
        """Publish a prepared :class:`Publication` and wait for its confirm."""
        if self._state is not ResourceState.OPEN or self._channel is None:
            raise LilyError(f"Publisher is {self._state.value}; open it first")
        underlay = await self._channel.get_underlay_channel()
        publish = functools.partial(
            basic_publish,
            underlay,
            exchange=publication.exchange,
            routing_key=publication.routing_key,
            body=publication.body,
            content_type=publication.content_type,
            timeout=self._confirm_timeout,
        )
        await self._observer.publish(
            lambda headers: publish(headers=headers),
            exchange=publication.exchange,
            routing_key=publication.routing_key,
            headers=publication.headers,
            event_id=publication.event_id,
        )
        return publication.event_id

    async def _publish[T](
        self, content: CustomPublishContent[T], routing_key: str, payload: T, version: int, options: PublishOptions
    ) -> uuid.UUID:
        return await self.send(prepare_publication(content, routing_key, payload, version=version, **options))
