"""DLQ triage and controlled replay: what ``lily-mongo dlq list`` and ``dlq replay`` do.

Every work queue ``Q`` has a dead-letter queue ``Q.dlq`` (docs/settlement.md, section 8). Two
paths lead there, with different evidence:

* a **library copy**: the consumer published a copy with publisher confirms and
  wrote ``x-lily-failure-code`` and the other failure headers itself (replacing
  any a producer had set);
* a **broker dead letter**: the consumer rejected the original (a body over
  ``max_body``, repeated handoff failures) and RabbitMQ moved it, adding an
  ``x-death`` entry for ``Q``. The message keeps its own headers, so an
  ``x-lily-failure-code`` on it was written by someone else (a producer, or an
  earlier retry copy) and says nothing about why it is here.

:func:`inspect_dead_letter` tells them apart by the broker's ``x-death`` entry,
which a producer cannot remove from a message the broker dead-lettered, and
reports a failure code the evidence does not back as untrusted.

Listing must not lose anything. Putting an inspected message back with
``basic.nack(requeue=true)`` counts as a failed delivery on quorum queues, which
drop a message past their delivery limit (20 by default on RabbitMQ 4.0 to 4.2).
So every inspected message is put back as a fresh copy at the end of the DLQ:
published with a publisher confirm, and only then is the inspected one ACKed.
A listing therefore moves the listed messages to the end of the queue; a failed
put-back requeues the inspected message instead and stops with an error.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import aio_pika.abc
import aiormq.abc
from pamqp import commands as spec
from yarl import URL

from ._amqp import AmqpMessage, channel_errors, connect_amqp, publish_properties
from ._checks import check_amqp_url, check_int, check_seconds
from ._errors import ConfigError, TransportError
from ._headers import (
    BROKER_COUNT_HEADERS,
    DEATH_HEADER,
    EVENT_ID_HEADER,
    FAILED_AT_HEADER,
    FAILED_QUEUE_HEADER,
    FAILURE_CODE_HEADER,
    FAILURE_HEADER_KEYS,
    FAILURE_REASON_HEADER,
    RETRY_COUNT_HEADER,
)
from ._nodes import split_nodes
from ._plan.options import QueueOptions
from ._text import describe_value, sanitize

__all__ = [
    "BROKER_DEATH_HEADERS",
    "DeadLetter",
    "DlqListing",
    "ReplayResult",
    "inspect_dead_letter",
    "list_dead_letters",
    "replay_dead_letters",
]

# Headers RabbitMQ writes when it dead-letters a message; a replay removes them.
BROKER_DEATH_HEADERS = (
    DEATH_HEADER,
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-last-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
)
# The broker's delivery counts of the copy in the DLQ: a fresh copy starts without them.
_SHOWN_TEXT = 512

Origin = Literal["library", "broker", "unknown"]


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One message of a DLQ, described only as far as the evidence on it goes."""

    event_id: str | None
    """``x-lily-event-id`` as found (not necessarily a valid one); None when absent."""
    origin: Origin
    """``library``: a copy the consumer made; ``broker``: RabbitMQ dead-lettered the original
    from the work queue; ``unknown``: neither (for instance published straight into the DLQ)."""
    code: str | None
    """The failure code the library wrote (library copies only)."""
    reason: str
    broker_reason: str | None
    """The ``x-death`` reason of a broker dead letter (``rejected``, ``expired``, ``maxlen``, ...)."""
    untrusted_code: str | None
    """An ``x-lily-failure-code`` the evidence does not back (broker dead letters, unknown origin)."""
    failed_at: str | None
    retry_count: int | None
    bytes: int
    malformed: str | None
    """Set when the message's metadata was not valid UTF-8 (read leniently)."""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    def display_code(self) -> str:
        """The code column of ``dlq list``: the trusted code, or the broker's path and the untrusted code."""
        if self.origin == "library":
            shown = self.code or "-"
        elif self.origin == "broker":
            shown = f"broker-native ({self.broker_reason or 'dead-lettered'})"
        else:
            shown = "unknown origin"
        if self.untrusted_code is not None:
            shown += f"; x-lily-failure-code {self.untrusted_code} (untrusted)"
        return shown


@dataclass(frozen=True, slots=True)
class DlqListing:
    """What ``dlq list`` saw: how many messages the DLQ held, and the ones inspected."""

    queue: str
    dlq: str
    total: int
    messages: tuple[DeadLetter, ...]


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What ``dlq replay`` did: messages inspected, moved back to the work queue, and put back."""

    scanned: int
    moved: int
    kept: int
    missing: tuple[str, ...]
    """Requested event ids that no inspected message carried."""


def _text(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return sanitize(value, _SHOWN_TEXT) if not value.isprintable() else value[:_SHOWN_TEXT]
    if isinstance(value, bytes | bytearray):
        return sanitize(bytes(value).decode("utf-8", "replace"), _SHOWN_TEXT)
    return describe_value(value)


def _latest_death(headers: Mapping[str, object]) -> tuple[str | None, str | None]:
    """(queue, reason) of the broker's most recent dead-lettering: the first ``x-death`` entry."""
    deaths = headers.get(DEATH_HEADER)
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], Mapping):
        queue, reason = deaths[0].get("queue"), deaths[0].get("reason")
        return (queue if isinstance(queue, str) else None, reason if isinstance(reason, str) else None)
    return None, None


def inspect_dead_letter(
    headers: Mapping[str, object], body_size: int, work_queue: str, *, malformed: str | None = None
) -> DeadLetter:
    """Describe one DLQ message of ``work_queue`` from its headers (pure).

    A message whose latest ``x-death`` entry names the work queue was dead-lettered by
    the broker from there: the library wrote nothing on it, whatever failure headers it
    carries. Otherwise a message with the library's failure code and the work queue as
    its failed queue is a library copy. Anything else is of unknown origin.
    """
    death_queue, death_reason = _latest_death(headers)
    raw_code = headers.get(FAILURE_CODE_HEADER)
    code = _text(raw_code) if raw_code is not None else None
    retry = headers.get(RETRY_COUNT_HEADER)
    origin: Origin
    if death_queue == work_queue:
        origin = "broker"
    elif isinstance(raw_code, str) and headers.get(FAILED_QUEUE_HEADER) == work_queue:
        origin = "library"
    else:
        origin = "unknown"
    return DeadLetter(
        event_id=_text(headers.get(EVENT_ID_HEADER)),
        origin=origin,
        code=code if origin == "library" else None,
        reason=(_text(headers.get(FAILURE_REASON_HEADER)) or "") if origin == "library" else "",
        broker_reason=death_reason if origin == "broker" else None,
        untrusted_code=code if origin != "library" else None,
        failed_at=_text(headers.get(FAILED_AT_HEADER)) if origin == "library" else None,
        retry_count=retry if type(retry) is int else None,
        bytes=body_size,
        malformed=malformed,
    )


def parse_event_ids(event_ids: Collection[str]) -> set[str]:
    """Event ids as given (any spelling ``uuid.UUID`` reads), in the canonical form headers carry."""
    wanted: set[str] = set()
    for text in event_ids:
        try:
            value = uuid.UUID(text) if isinstance(text, str) else None
        except ValueError:
            value = None
        if value is None or value.int == 0:
            raise ConfigError(f"event id {_text(text)!r} is not a UUID (nor may it be the nil UUID)")
        wanted.add(str(value))
    return wanted


class _Session:
    """One connection with a channel to read the DLQ and a confirming channel to publish on."""

    def __init__(self, amqp_url: str | Sequence[str], queue: str) -> None:
        self.url = check_amqp_url("amqp_url", amqp_url)  # one URL for a cluster's nodes (docs/deployment.md)
        self.queue = queue
        self.dlq = QueueOptions(name=queue).dlq_name  # also checks the queue name's bounds
        self.user = URL(split_nodes(self.url)[0]).user or "guest"
        self.connection: aio_pika.abc.AbstractConnection | None = None
        self.reader: aiormq.abc.AbstractChannel | None = None
        self.publisher: aiormq.abc.AbstractChannel | None = None

    async def __aenter__(self) -> _Session:
        self.connection = await connect_amqp(self.url, robust=False)
        try:
            with channel_errors("opening the DLQ tool's channels"):
                self.reader = await (await self.connection.channel(publisher_confirms=False)).get_underlay_channel()
                confirming = await self.connection.channel(publisher_confirms=True, on_return_raises=True)
                self.publisher = await confirming.get_underlay_channel()
        except BaseException:
            await self.connection.close()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self.connection is not None:
            await self.connection.close()

    async def depth(self, name: str) -> int:
        """Ready messages in ``name`` (a passive declare on a channel of its own: a 404 closes it)."""
        assert self.connection is not None
        errors = channel_errors(
            f"checking queue {name!r}",
            not_found=(
                f"queue {name!r} does not exist on the broker; give the work queue's name (its DLQ is <name>.dlq)"
            ),
        )
        with errors:
            channel = await self.connection.channel(publisher_confirms=False)
            try:
                declared = await channel.declare_queue(name, passive=True)
            finally:
                if not channel.is_closed:
                    await channel.close()
        return int(declared.declaration_result.message_count or 0)

    async def get(self) -> AmqpMessage | None:
        assert self.reader is not None
        with channel_errors(f"reading {self.dlq!r}"):
            delivered = await self.reader.basic_get(self.dlq, no_ack=False)
        if not isinstance(delivered.delivery, spec.Basic.GetOk):
            return None
        return AmqpMessage(delivered)

    async def put_back(self, message: AmqpMessage, timeout: float) -> None:
        """Move ``message`` to the end of the DLQ as a fresh copy (confirmed), then ACK it.

        A message read leniently (its metadata was not valid UTF-8) is requeued instead:
        a copy would replace its original bytes with the lenient reading.
        """
        assert self.publisher is not None
        with channel_errors(f"putting a message back in {self.dlq!r}"):
            if message.malformed is not None:
                await message.nack(requeue=True)
                return
            headers = {k: v for k, v in message.headers.items() if k not in BROKER_COUNT_HEADERS}
            # The broker accepts user_id only when it names the publishing connection's user.
            drop = ("cluster_id",) if message.user_id in (None, self.user) else ("cluster_id", "user_id")
            try:
                await publish_properties(
                    self.publisher,
                    exchange="",
                    routing_key=self.dlq,
                    body=message.body,
                    properties=message.properties_with(headers, drop=drop),
                    timeout=timeout,
                )
            except TransportError:
                await message.nack(requeue=True)  # nothing lost: the inspected message goes back
                raise
            await message.ack()

    async def move(self, message: AmqpMessage, headers: Mapping[str, Any], timeout: float) -> None:
        """Publish ``message`` with ``headers`` to the work queue (confirmed), then ACK the DLQ copy."""
        assert self.publisher is not None
        with channel_errors(f"moving a message of {self.dlq!r} to {self.queue!r}"):
            # What a retry copy keeps (settlement.md, section 7): not the expiration (the copy must not
            # expire on the way), nor user_id (the broker checks it against this connection's user);
            # a fresh message id, persistent.
            properties = message.properties_with(headers, drop=("expiration", "user_id", "cluster_id"))
            properties.message_id = uuid.uuid4().hex
            properties.delivery_mode = 2
            try:
                await publish_properties(
                    self.publisher,
                    exchange="",
                    routing_key=self.queue,
                    body=message.body,
                    properties=properties,
                    timeout=timeout,
                )
            except TransportError:
                await message.nack(requeue=True)
                raise
            await message.ack()


async def list_dead_letters(
    amqp_url: str | Sequence[str], queue: str, *, limit: int = 100, confirm_timeout: float = 10.0
) -> DlqListing:
    """Inspect up to ``limit`` messages of ``queue``'s DLQ, oldest first, putting each one back.

    Raises :class:`ConfigError` (the DLQ does not exist, a bad argument) or
    :class:`TransportError` (the broker is unreachable or refused the connection).
    """
    check_int("limit", limit, 1, 100_000)
    check_seconds("confirm_timeout", confirm_timeout, low=0, high=3600, low_inclusive=False)
    async with _Session(amqp_url, queue) as session:
        total = await session.depth(session.dlq)
        seen: list[DeadLetter] = []
        # Bounded by the depth seen at the start: put-back copies queue up behind it.
        for _ in range(min(limit, total)):
            message = await session.get()
            if message is None:
                break
            seen.append(inspect_dead_letter(message.headers, len(message.body), queue, malformed=message.malformed))
            await session.put_back(message, confirm_timeout)
    return DlqListing(queue, session.dlq, total, tuple(seen))


async def replay_dead_letters(
    amqp_url: str | Sequence[str],
    queue: str,
    *,
    event_ids: Collection[str] = (),
    replay_all: bool = False,
    reset_retries: bool = False,
    limit: int = 10_000,
    confirm_timeout: float = 10.0,
) -> ReplayResult:
    """Move the selected DLQ messages back to ``queue``: publish + confirm, then ACK the DLQ copy.

    Select with ``event_ids`` or ``replay_all``, exactly one of them. A moved message
    keeps its body, properties and headers but loses the failure and ``x-death``
    headers; ``reset_retries`` sets ``x-retry-count`` to 0. The others are put back
    (see the module docstring). Requested event ids found on no message are returned
    in ``missing``.
    """
    if replay_all and event_ids:
        raise ConfigError("give event ids or replay_all, not both: replay_all would replay every message")
    if not replay_all and not event_ids:
        raise ConfigError("give the event ids to replay, or replay_all")
    wanted = parse_event_ids(event_ids)
    check_int("limit", limit, 1, 100_000)
    check_seconds("confirm_timeout", confirm_timeout, low=0, high=3600, low_inclusive=False)
    found: set[str] = set()
    moved = kept = scanned = 0
    async with _Session(amqp_url, queue) as session:
        total = await session.depth(session.dlq)
        await session.depth(queue)  # the destination must exist: a replay is not a declaration
        for _ in range(min(limit, total)):
            message = await session.get()
            if message is None:
                break
            scanned += 1
            event_id = message.headers.get(EVENT_ID_HEADER)
            if not replay_all and not (isinstance(event_id, str) and event_id in wanted):
                await session.put_back(message, confirm_timeout)
                kept += 1
                continue
            if isinstance(event_id, str):
                found.add(event_id)
            headers = {
                k: v
                for k, v in message.headers.items()
                if k not in FAILURE_HEADER_KEYS and k not in BROKER_DEATH_HEADERS and k not in BROKER_COUNT_HEADERS
            }
            if reset_retries:
                headers[RETRY_COUNT_HEADER] = 0
            await session.move(message, headers, confirm_timeout)
            moved += 1
    return ReplayResult(scanned, moved, kept, tuple(sorted(wanted - found)))
