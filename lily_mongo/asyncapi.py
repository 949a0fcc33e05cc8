"""An AsyncAPI 3.0 document generated from a consumer plan (docs/asyncapi.md).

One channel per physical queue plus its retry buckets and DLQ; one receive
operation per queue; one message per (schema version, content kind) with the
payload JSON Schema from the handler's pydantic model and the Lily envelope
headers as the header schema. The DLQ message describes both kinds of dead
letter that reach a DLQ. Messages the service declares with ``Consumer.sends``
get a channel and a ``send`` operation each. Pure: reads the plan and the
declarations only.
"""

from __future__ import annotations

import hashlib
import re
import typing
from collections.abc import Iterable
from typing import Any

from ._headers import (
    CONTENT_KIND_HEADER,
    DEATH_HEADER,
    EVENT_ID_HEADER,
    FAILED_AT_HEADER,
    FAILED_QUEUE_HEADER,
    FAILURE_CODE_HEADER,
    FAILURE_REASON_HEADER,
    RETRY_COUNT_HEADER,
    SCHEMA_VERSION_HEADER,
    TRACEPARENT_HEADER,
    TRACESTATE_HEADER,
)
from ._plan.extractors import Bytes, Extractor, Json, Text
from ._plan.outgoing import OutgoingMessage
from ._plan.plan import Plan
from .bounds import BOUNDS
from .content import BUILTIN_CONTENT
from .envelope import CONTENT_KIND_PATTERN, EVENT_ID_PATTERN, SCHEMA_VERSION_PATTERN

__all__ = ["asyncapi_document"]

_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")
# Application-defined content kinds: the document cannot know their MIME type.
_OTHER_CONTENT_TYPE = "application/octet-stream"


def _component_id(text: str) -> str:
    """AsyncAPI component and channel keys must match ``^[A-Za-z0-9_.-]+$``.

    A name that needs rewriting gets a short digest of the original, so two
    queues whose names rewrite alike ("a b", "a_b") keep distinct keys.
    """
    safe = _ID_UNSAFE.sub("_", text)
    if safe == text:
        return text
    return f"{safe}-{hashlib.blake2b(text.encode(), digest_size=4).hexdigest()}"


def _content_type(content: str) -> str:
    builtin = BUILTIN_CONTENT.get(content)
    return builtin.content_type if builtin is not None else _OTHER_CONTENT_TYPE


def _envelope_headers(version: int, content: str) -> dict[str, Any]:
    """The canonical envelope of a message of ``version`` and ``content`` (contracts.md, section 1)."""
    return {
        "type": "object",
        "required": [EVENT_ID_HEADER, SCHEMA_VERSION_HEADER, CONTENT_KIND_HEADER],
        "properties": {
            EVENT_ID_HEADER: {
                "type": "string",
                "description": "Canonical lowercase hyphenated UUID, not nil; preserved across retries, DLQ and "
                "replays.",
                "pattern": f"^{EVENT_ID_PATTERN}$",
            },
            SCHEMA_VERSION_HEADER: {
                "type": "string",
                "description": "Payload contract version as a canonical decimal string (AMQP long string).",
                "pattern": f"^{SCHEMA_VERSION_PATTERN}$",
                "const": str(version),
            },
            CONTENT_KIND_HEADER: {
                "type": "string",
                "description": "Content contract token chosen by the publisher.",
                "pattern": f"^{CONTENT_KIND_PATTERN}$",
                "maxLength": BOUNDS.content_kind_max_bytes,
                "const": content,
            },
            RETRY_COUNT_HEADER: {
                "type": "integer",
                "minimum": 0,
                "maximum": BOUNDS.retry_count_max,
                "description": "Application retries so far (AMQP integer; published as signed 32-bit). Absent means 0.",
            },
            TRACEPARENT_HEADER: {"type": "string", "maxLength": BOUNDS.traceparent_bytes},
            TRACESTATE_HEADER: {"type": "string", "maxLength": BOUNDS.tracestate_bytes},
        },
    }


def _dead_letter_headers(work_queue: str) -> dict[str, Any]:
    """What a message in ``work_queue``'s DLQ carries: a library copy or a broker dead letter.

    The envelope headers are the original's, as it carried them: a copy of a message
    refused for its envelope may lack them or hold anything, so they are described,
    not constrained.
    """
    as_sent = "As the original message carried it; a copy of a message refused for its envelope may lack it or "
    return {
        "type": "object",
        "properties": {
            EVENT_ID_HEADER: {"description": f"{as_sent}carry an invalid value. Otherwise a canonical UUID."},
            SCHEMA_VERSION_HEADER: {"description": f"{as_sent}carry an invalid value."},
            CONTENT_KIND_HEADER: {"description": f"{as_sent}carry an invalid value."},
            RETRY_COUNT_HEADER: {
                "description": "Library copies: the retries used (integer 0..100), absent when "
                "the envelope was invalid. Broker dead letters: the original's, as it was."
            },
        },
        "anyOf": [
            {
                "title": "Library copy",
                "description": f"Published by the consumer (with a publisher confirm) after a permanent failure, "
                f"exhausted retries or deferrals, or a contract violation on {work_queue}.",
                "required": [FAILURE_CODE_HEADER, FAILURE_REASON_HEADER, FAILED_QUEUE_HEADER, FAILED_AT_HEADER],
                "properties": {
                    FAILURE_CODE_HEADER: {"type": "string", "minLength": 1, "maxLength": BOUNDS.failure_code_bytes},
                    FAILURE_REASON_HEADER: {
                        "type": "string",
                        "maxLength": BOUNDS.failure_reason_bytes,
                        "pattern": "^[ -~]*$",
                        "description": "Printable ASCII: anything else was replaced by '?'.",
                    },
                    FAILED_QUEUE_HEADER: {"type": "string", "const": work_queue},
                    FAILED_AT_HEADER: {"type": "string", "format": "date-time"},
                    RETRY_COUNT_HEADER: {"type": "integer", "minimum": 0, "maximum": BOUNDS.retry_count_max},
                },
            },
            {
                "title": "Broker dead letter",
                "description": f"The original message, rejected by the consumer (a body over max_body, repeated "
                f"handoff failures) and dead-lettered by RabbitMQ: its latest x-death entry names {work_queue}. Any "
                "x-lily-failure-* header on it was not written by the consumer.",
                "required": [DEATH_HEADER],
                "properties": {
                    DEATH_HEADER: {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["queue", "reason"],
                            "properties": {
                                "queue": {"type": "string"},
                                "reason": {"type": "string"},
                                "count": {"type": "integer"},
                                "time": {"type": "string", "format": "date-time"},
                                "exchange": {"type": "string"},
                                "routing-keys": {"type": "array", "items": {"type": "string"}},
                            },
                        },
                    },
                },
            },
        ],
    }


def _payload(extractor: Extractor | None, message_id: str, schemas: dict[str, Any]) -> dict[str, Any]:
    """The JSON Schema of what ``extractor`` accepts; nested model definitions go to ``schemas``.

    Model schemas are namespaced per message: two versions may both define a nested
    model called "Line" with different fields.
    """
    if extractor is None:
        return {}
    payload = extractor.payload_schema(f"#/components/schemas/{message_id}.{{model}}")
    for name, definition in payload.pop("$defs", {}).items():
        schemas[f"{message_id}.{name}"] = definition
    return payload


def _outgoing_extractor(message: OutgoingMessage) -> Extractor | None:
    """What a consumer of the outgoing message would declare as its payload parameter."""
    if message.content == "json":
        if message.payload is None:
            return None
        annotation: Any = typing.cast(Any, Json)[message.payload]
    elif message.content == "text":
        annotation = Text
    elif message.content == "binary":
        annotation = Bytes
    else:
        return None
    base, marker = typing.get_args(annotation)[:2]
    assert isinstance(marker, Extractor)
    return marker.bind(base)


def asyncapi_document(
    plan: Plan | None,
    *,
    outgoing: Iterable[OutgoingMessage] = (),
    title: str | None = None,
    version: str = "1.0.0",
) -> dict[str, Any]:
    """Build the AsyncAPI 3.0.0 document of ``plan`` (and of the ``outgoing`` messages the service declares
    with ``Consumer.sends`` or ``Outbox.sends``) as plain JSON-compatible data. ``plan=None`` documents
    what a service that consumes nothing sends (a web application writing through an ``Outbox``)."""
    if plan is None:
        plan = Plan(title or "outbox", {}, {}, (), (), ())
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    schemas: dict[str, Any] = {}
    for queue_name, options in plan.queues.items():
        channel_id = _component_id(queue_name)
        refs: dict[str, Any] = {}
        for by_content in plan.routes.get(queue_name, {}).values():
            for route in by_content.values():
                message_id = _component_id(f"{queue_name}.v{route.version}.{route.content}")
                terminal = route.terminal
                messages[message_id] = {
                    "name": message_id,
                    "title": f"{queue_name} v{route.version} ({route.content})",
                    "summary": f"Handled by {route.handler_id} with the {route.guarantee} guarantee.",
                    "contentType": _content_type(route.content),
                    "headers": _envelope_headers(route.version, route.content),
                    "payload": _payload(terminal.extractor if terminal else None, message_id, schemas),
                }
                refs[message_id] = {"$ref": f"#/components/messages/{message_id}"}
        channels[channel_id] = {
            "address": queue_name,
            "title": queue_name,
            "description": f"Work queue ({options.queue_type}); broker-native rejections dead-letter to "
            f"{options.dlq_name}.",
            "messages": refs,
        }
        for index, delay_ms in enumerate(options.retry.bucket_delays_ms):
            bucket = options.bucket_name(index)
            channels[_component_id(bucket)] = {
                "address": bucket,
                "description": f"Retry bucket: copies wait {delay_ms} ms (queue TTL), then return to {queue_name}.",
                "messages": {f"{mid}": {"$ref": f"#/components/messages/{mid}"} for mid in refs},
            }
        dlq_message = _component_id(f"{queue_name}.dead-lettered")
        messages[dlq_message] = {
            "name": dlq_message,
            "title": f"Dead-lettered copy from {queue_name}",
            "summary": "A library copy (the original body and bounded headers plus the x-lily-failure-* headers) "
            "or a broker dead letter (the original message with RabbitMQ's x-death headers).",
            "headers": _dead_letter_headers(queue_name),
            "payload": {},
        }
        channels[_component_id(options.dlq_name)] = {
            "address": options.dlq_name,
            "description": "Dead-letter queue: permanent failures, exhausted retries or deferrals, broker-native "
            "rejections (oversize bodies, repeated handoff failures).",
            "messages": {dlq_message: {"$ref": f"#/components/messages/{dlq_message}"}},
        }
        operations[_component_id(f"receive.{queue_name}")] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{channel_id}"},
            "summary": f"Consume {queue_name} with up to {options.concurrency} concurrent handlers.",
            "messages": [{"$ref": f"#/channels/{channel_id}/messages/{mid}"} for mid in refs],
        }
    sends: dict[str, list[OutgoingMessage]] = {}
    for message in outgoing:
        destination = f"{message.exchange}.{message.routing_key}" if message.exchange else message.routing_key
        sends.setdefault(destination, []).append(message)
    for destination, declared in sends.items():
        channel_id = _component_id(f"send.{destination}")
        first = declared[0]
        where = (
            f"exchange {first.exchange} with routing key {first.routing_key}"
            if first.exchange
            else f"queue {first.routing_key} (through the default exchange)"
        )
        refs = {}
        for message in declared:
            message_id = _component_id(f"send.{destination}.v{message.version}.{message.content}")
            messages[message_id] = {
                "name": message_id,
                "title": f"{first.routing_key} v{message.version} ({message.content})",
                "summary": "Published by this service (through its outbox or a Publisher).",
                "contentType": _content_type(message.content),
                "headers": _envelope_headers(message.version, message.content),
                "payload": _payload(_outgoing_extractor(message), message_id, schemas),
            }
            refs[message_id] = {"$ref": f"#/components/messages/{message_id}"}
        channels[channel_id] = {
            "address": first.routing_key,
            "title": destination,
            "description": f"Messages this service publishes to {where}: mandatory, with publisher confirms.",
            "messages": refs,
        }
        operations[channel_id] = {
            "action": "send",
            "channel": {"$ref": f"#/channels/{channel_id}"},
            "summary": f"Publish to {where}.",
            "messages": [{"$ref": f"#/channels/{channel_id}/messages/{mid}"} for mid in refs],
        }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": title or plan.name,
            "version": version,
            "description": "Generated by lily_mongo from the registered handlers and declared outgoing messages.",
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": schemas},
    }
