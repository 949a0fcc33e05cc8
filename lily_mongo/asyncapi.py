"""An AsyncAPI 3.0 document generated from a consumer plan (SPEC section 6).

One channel per physical queue plus its retry buckets and DLQ; one receive
operation per queue; one message per (schema version, content kind) with the
payload JSON Schema from the handler's pydantic model and the Lily envelope
headers as the header schema. Pure: reads the plan only.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from .bounds import BOUNDS
from .envelope import (
    CONTENT_KIND_HEADER,
    EVENT_ID_HEADER,
    RETRY_COUNT_HEADER,
    SCHEMA_VERSION_HEADER,
    TRACEPARENT_HEADER,
    TRACESTATE_HEADER,
)
from .plan import HandlerRoute, Plan

__all__ = ["asyncapi_document"]

_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")
_MIME = {"json": "application/json", "text": "text/plain; charset=utf-8", "binary": "application/octet-stream"}


def _component_id(text: str) -> str:
    """AsyncAPI component and channel keys must match ``^[A-Za-z0-9_.-]+$``.

    A name that needs rewriting gets a short digest of the original, so two
    queues whose names rewrite alike ("a b", "a_b") keep distinct keys.
    """
    safe = _ID_UNSAFE.sub("_", text)
    if safe == text:
        return text
    return f"{safe}-{hashlib.blake2b(text.encode(), digest_size=4).hexdigest()}"


def _envelope_headers(route: HandlerRoute | None) -> dict[str, Any]:
    properties: dict[str, Any] = {
        EVENT_ID_HEADER: {
            "type": "string",
            "description": "Canonical lowercase hyphenated UUID, not nil; preserved across retries, DLQ and replays.",
            "pattern": "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$",
        },
        SCHEMA_VERSION_HEADER: {
            "type": "string",
            "description": "Payload contract version as a canonical decimal string (AMQP long string).",
            "pattern": "^[1-9][0-9]{0,4}$",
        },
        CONTENT_KIND_HEADER: {
            "type": "string",
            "description": "Content contract token chosen by the publisher.",
            "pattern": "^[a-z0-9][a-z0-9._+-]*$",
            "maxLength": BOUNDS.content_kind_max_bytes,
        },
        RETRY_COUNT_HEADER: {
            "type": "integer",
            "minimum": 0,
            "maximum": BOUNDS.retry_count_max,
            "description": "Application retries so far (AMQP integer; published as signed 32-bit). Absent means 0.",
        },
        TRACEPARENT_HEADER: {"type": "string", "maxLength": BOUNDS.traceparent_bytes},
        TRACESTATE_HEADER: {"type": "string", "maxLength": BOUNDS.tracestate_bytes},
    }
    if route is not None:
        properties[SCHEMA_VERSION_HEADER] = {**properties[SCHEMA_VERSION_HEADER], "const": str(route.version)}
        properties[CONTENT_KIND_HEADER] = {**properties[CONTENT_KIND_HEADER], "const": route.content}
    return {
        "type": "object",
        "required": [EVENT_ID_HEADER, SCHEMA_VERSION_HEADER, CONTENT_KIND_HEADER],
        "properties": properties,
    }


def _failure_headers() -> dict[str, Any]:
    schema = _envelope_headers(None)
    schema["properties"].update(
        {
            "x-lily-failure-code": {"type": "string", "maxLength": BOUNDS.failure_code_bytes},
            "x-lily-failure-reason": {"type": "string", "maxLength": BOUNDS.failure_reason_bytes},
            "x-lily-failed-queue": {"type": "string"},
            "x-lily-failed-at": {"type": "string", "format": "date-time"},
        }
    )
    return schema


def asyncapi_document(plan: Plan, *, title: str | None = None, version: str = "1.0.0") -> dict[str, Any]:
    """Build the AsyncAPI 3.0.0 document of ``plan`` as plain JSON-compatible data."""
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
                payload: dict[str, Any] = {}
                terminal = route.terminal
                if terminal is not None and terminal.extractor is not None:
                    # Model schemas are namespaced per message: two versions may both
                    # define a nested model called "Line" with different fields.
                    template = f"#/components/schemas/{message_id}.{{model}}"
                    payload = terminal.extractor.payload_schema(template)
                    for name, definition in payload.pop("$defs", {}).items():
                        schemas[f"{message_id}.{name}"] = definition
                messages[message_id] = {
                    "name": message_id,
                    "title": f"{queue_name} v{route.version} ({route.content})",
                    "summary": f"Handled by {route.handler_id} with the {route.guarantee} guarantee.",
                    "contentType": _MIME.get(route.content, "application/octet-stream"),
                    "headers": _envelope_headers(route),
                    "payload": payload,
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
            "summary": "The original body and bounded headers plus the x-lily-failure-* headers.",
            "headers": _failure_headers(),
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
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": title or plan.name,
            "version": version,
            "description": "Generated by lily_mongo from the registered handlers.",
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": schemas},
    }
