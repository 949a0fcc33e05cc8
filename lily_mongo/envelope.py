"""The canonical message envelope and the metadata bounds (docs/contracts.md).

Pure: imports no I/O library, so it can run on every delivery in microseconds
and be fuzzed. :func:`validate_envelope` is the first thing the consumer calls
after reading a delivery's headers and body size.
"""

from __future__ import annotations

import datetime
import decimal
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from ._errors import EnvelopeError, ErrorCode
from ._fast import canonical_uuid, slot_constructor
from ._headers import (
    CONTENT_KIND_HEADER,
    DELIVERY_COUNT_HEADER,
    EVENT_ID_HEADER,
    FAILED_AT_HEADER,
    FAILED_QUEUE_HEADER,
    FAILURE_CODE_HEADER,
    FAILURE_REASON_HEADER,
    HANDOFF_HEADER_KEYS,
    RETRY_COUNT_HEADER,
    SCHEMA_VERSION_HEADER,
    TRACEPARENT_HEADER,
    TRACESTATE_HEADER,
)
from ._text import describe_key, describe_value
from .bounds import BOUNDS, utf8_len

__all__ = [
    "CONTENT_KIND_HEADER",
    "CONTENT_KIND_PATTERN",
    "DELIVERY_COUNT_HEADER",
    "EVENT_ID_HEADER",
    "EVENT_ID_PATTERN",
    "FAILED_AT_HEADER",
    "FAILED_QUEUE_HEADER",
    "FAILURE_CODE_HEADER",
    "FAILURE_REASON_HEADER",
    "HANDOFF_HEADER_KEYS",
    "RETRY_COUNT_HEADER",
    "SCHEMA_VERSION_HEADER",
    "SCHEMA_VERSION_PATTERN",
    "TRACEPARENT_HEADER",
    "TRACESTATE_HEADER",
    "Envelope",
    "EnvelopeError",
    "check_content_kind",
    "event_id_of",
    "is_canonical_uuid",
    "sanitize_headers",
    "valid_traceparent",
    "validate_envelope",
]


# The canonical forms, spelled once (the AsyncAPI document anchors them as JSON Schema
# patterns). Matched with ``re.fullmatch`` and explicit ASCII classes: ``$`` would accept
# a trailing newline and ``\d`` would accept non-ASCII digits.
EVENT_ID_PATTERN = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
SCHEMA_VERSION_PATTERN = "[1-9][0-9]{0,4}"
CONTENT_KIND_PATTERN = "[a-z0-9][a-z0-9._+-]*"
_UUID_RE = re.compile(EVENT_ID_PATTERN)
_VERSION_RE = re.compile(SCHEMA_VERSION_PATTERN)
_CONTENT_KIND_RE = re.compile(CONTENT_KIND_PATTERN)
# W3C traceparent: hex fields; version ff, an all-zero trace id or parent id are invalid.
_TRACEPARENT_RE = re.compile(r"(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
_NIL_UUID = "00000000-0000-0000-0000-000000000000"

# Fixed sizes charged for non-string AMQP values (their wire width).
_SCALAR_SIZES: dict[type, int] = {
    bool: 1,
    int: 8,
    float: 8,
    decimal.Decimal: 5,
    datetime.datetime: 8,
    type(None): 0,
}
_HANDOFF_KEYS_COUNT = len(HANDOFF_HEADER_KEYS)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True, slots=True)
class Envelope:
    """The validated canonical envelope of one delivery."""

    event_id: uuid.UUID
    schema_version: int
    content_kind: str
    retry_count: int
    traceparent: str | None
    tracestate: str | None


# The per-delivery constructors: see _fast.py for why and what they save.
_new_envelope = slot_constructor(Envelope)


def is_canonical_uuid(text: object) -> bool:
    """True for lowercase, hyphenated 8-4-4-4-12 UUID text that is not the nil UUID."""
    return isinstance(text, str) and _UUID_RE.fullmatch(text) is not None and text != _NIL_UUID


def event_id_of(headers: Mapping[str, object] | None) -> uuid.UUID | None:
    """The event id of a delivery whose envelope may be invalid: None unless its header is canonical.

    For what a refused delivery is reported with (observations, log lines): the id is
    named whenever its own header was valid, whatever else was wrong.
    """
    text = headers.get(EVENT_ID_HEADER) if isinstance(headers, Mapping) else None
    return canonical_uuid(text) if isinstance(text, str) and is_canonical_uuid(text) else None


def check_content_kind(kind: object) -> str | None:
    """Return why ``kind`` is not a canonical content kind token, or None when it is."""
    if not isinstance(kind, str):
        return f"must be a string, got {describe_value(kind)}"
    if not kind:
        return "must not be empty"
    if len(kind) > BOUNDS.content_kind_max_bytes:
        return f"is {utf8_len(kind)} bytes, over the bound of {BOUNDS.content_kind_max_bytes} bytes"
    if _CONTENT_KIND_RE.fullmatch(kind) is None:
        return f"must match [a-z0-9][a-z0-9._+-]*, got {describe_value(kind)}"
    return None


def _bounds_error(reason: str) -> EnvelopeError:
    return EnvelopeError(ErrorCode.METADATA_BOUNDS_EXCEEDED, reason)


def _invalid(reason: str) -> EnvelopeError:
    return EnvelopeError(ErrorCode.ENVELOPE_INVALID, reason)


class _Walk:
    """Counts nested elements across one header table."""

    __slots__ = ("elements",)

    def __init__(self) -> None:
        self.elements = 0

    def size(self, key: str, value: object, depth: int) -> int:
        """AMQP payload bytes of ``value``; raises on depth, element and type violations."""
        kind = type(value)
        if kind is str:
            return utf8_len(value)  # type: ignore[arg-type]
        if kind is bytes or kind is bytearray:
            return len(value)  # type: ignore[arg-type]
        scalar = _SCALAR_SIZES.get(kind)
        if scalar is not None:
            if kind is int and not _INT64_MIN <= value <= _INT64_MAX:  # type: ignore[operator]
                raise _invalid(f"header {describe_key(key)} holds an integer outside the AMQP signed 64-bit range")
            return scalar
        if isinstance(value, Mapping | list | tuple):
            if depth >= BOUNDS.metadata_depth:
                raise _bounds_error(
                    f"header {describe_key(key)} nests deeper than the bound of {BOUNDS.metadata_depth} levels"
                )
            items = list(value.items()) if isinstance(value, Mapping) else list(enumerate(value))
            self.elements += len(items)
            if self.elements > BOUNDS.metadata_elements:
                raise _bounds_error(f"nested metadata has more than {BOUNDS.metadata_elements} elements (bound)")
            total = 0
            for inner_key, inner in items:
                if isinstance(value, Mapping):
                    if not isinstance(inner_key, str):
                        raise _invalid(f"header {describe_key(key)} has a table key that is not a string")
                    inner_key_bytes = utf8_len(inner_key)
                    if inner_key_bytes > BOUNDS.header_key_bytes:
                        raise _bounds_error(
                            f"header {describe_key(key)} has a nested key of {inner_key_bytes} bytes, "
                            f"over the bound of {BOUNDS.header_key_bytes} bytes"
                        )
                    total += inner_key_bytes
                total += self.size(key, inner, depth + 1)
            return total
        if isinstance(value, str | bytes | bool | int | float | decimal.Decimal | datetime.datetime):
            # Subclasses of AMQP types are charged like their base type.
            if isinstance(value, str):
                return utf8_len(value)
            if isinstance(value, bytes):
                return len(value)
            return 8
        raise _invalid(f"header {describe_key(key)} holds a {describe_value(value)}, which is not an AMQP field value")


def _check_metadata(headers: Mapping[str, object]) -> None:
    entries = len(headers)
    # Room for the framework's own handoff headers (replaced when already present).
    reserved_extra = _HANDOFF_KEYS_COUNT - len(HANDOFF_HEADER_KEYS.intersection(headers))
    if entries + reserved_extra > BOUNDS.header_entries:
        raise _bounds_error(
            f"{entries} header entries plus {reserved_extra} reserved for handoff headers "
            f"exceed the bound of {BOUNDS.header_entries}"
        )
    walk: _Walk | None = None
    aggregate = 0
    total = 0
    for key, value in headers.items():
        # Fast path for the common header: short ASCII text key and value (bytes == characters).
        if type(value) is str and type(key) is str and key.isascii() and value.isascii():
            size = len(key) + len(value)
            if 0 < len(key) <= BOUNDS.header_key_bytes and len(value) <= BOUNDS.header_value_bytes:
                total += size
                if key not in HANDOFF_HEADER_KEYS:
                    aggregate += size
                continue
        if walk is None:
            walk = _Walk()
        if not isinstance(key, str):
            raise _invalid(f"header key is a {type(key).__name__}, not a string")
        key_bytes = utf8_len(key)
        if key_bytes > BOUNDS.header_key_bytes or key_bytes == 0:
            raise _bounds_error(
                f"header key of {key_bytes} bytes is outside 1..{BOUNDS.header_key_bytes} bytes "
                f"(starts {describe_key(key)})"
            )
        if isinstance(value, str) and len(value) > BOUNDS.header_value_bytes:
            # Cheap early exit before encoding a huge string: characters <= bytes.
            raise _bounds_error(
                f"header {describe_key(key)} value is over the bound of {BOUNDS.header_value_bytes} bytes"
            )
        size = walk.size(key, value, 0)
        if size > BOUNDS.header_value_bytes:
            raise _bounds_error(
                f"header {describe_key(key)} value is {size} bytes, over the bound of {BOUNDS.header_value_bytes} bytes"
            )
        total += key_bytes + size
        if key not in HANDOFF_HEADER_KEYS:
            aggregate += key_bytes + size
    if total > BOUNDS.metadata_aggregate_bytes:
        raise _bounds_error(f"metadata is {total} bytes, over the bound of {BOUNDS.metadata_aggregate_bytes} bytes")
    allowed = BOUNDS.metadata_aggregate_bytes - BOUNDS.handoff_reserve_bytes
    if aggregate > allowed:
        raise _bounds_error(
            f"metadata is {aggregate} bytes, over the bound of {allowed} bytes "
            f"({BOUNDS.metadata_aggregate_bytes} less {BOUNDS.handoff_reserve_bytes} reserved for handoff headers)"
        )


def valid_traceparent(text: str) -> bool:
    """True for a W3C ``traceparent`` a receiver continues (docs/contracts.md section 3): lower-case hex
    fields of the version-00 lengths, a version other than ``ff``, no all-zero id."""
    return _TRACEPARENT_RE.fullmatch(text) is not None


def _required_str(headers: Mapping[str, object], name: str) -> str:
    value = headers.get(name)
    if value is None:
        raise _invalid(f"header {name!r} is required and missing")
    if not isinstance(value, str):
        raise _invalid(f"header {name!r} must be an AMQP string, got {describe_value(value)}")
    return value


def _optional_trace(headers: Mapping[str, object], name: str, bound: int) -> str | None:
    value = headers.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _invalid(f"header {name!r} must be an AMQP string, got {describe_value(value)}")
    if utf8_len(value) > bound:
        raise _bounds_error(f"header {name!r} is {utf8_len(value)} bytes, over the bound of {bound} bytes")
    return value


# Schema versions and content kinds the full path has accepted (bounded: a
# producer sending ever new values only keeps them out of the fast path).
_KNOWN_LIMIT = 256
_known_versions: dict[object, int] = {}
_known_kinds: dict[object, str] = {}
_FAST_ENTRIES = BOUNDS.header_entries - _HANDOFF_KEYS_COUNT
_FAST_BYTES = BOUNDS.metadata_aggregate_bytes - BOUNDS.handoff_reserve_bytes
_KEY_BYTES = BOUNDS.header_key_bytes
_VALUE_BYTES = BOUNDS.header_value_bytes
_RETRY_MAX = BOUNDS.retry_count_max
_TRACEPARENT_BYTES = BOUNDS.traceparent_bytes
_TRACESTATE_BYTES = BOUNDS.tracestate_bytes


def _accept_common(headers: dict[str, object]) -> Envelope | None:
    """Accept the common delivery in one pass, or return None for the full path.

    Only ASCII text and integer headers, few and small enough that every
    metadata bound holds whatever handoff headers are present, with a schema
    version and content kind the full path has accepted before. It never
    rejects: anything else (including every invalid delivery) goes through the
    full checks, which decide and explain. A property test holds both paths equal.
    """
    if len(headers) > _FAST_ENTRIES:
        return None
    total = 0
    for key, value in headers.items():
        if type(key) is not str or not key.isascii() or not 0 < len(key) <= _KEY_BYTES:
            return None
        if type(value) is str:
            if not value.isascii() or len(value) > _VALUE_BYTES:
                return None
            total += len(key) + len(value)
        elif type(value) is int and _INT64_MIN <= value <= _INT64_MAX:
            total += len(key) + 8
        else:
            return None
    if total > _FAST_BYTES:  # the aggregate excludes handoff headers, so it is at most the total
        return None
    event_text = headers.get(EVENT_ID_HEADER)
    if type(event_text) is not str or _UUID_RE.fullmatch(event_text) is None or event_text == _NIL_UUID:
        return None
    version = _known_versions.get(headers.get(SCHEMA_VERSION_HEADER))
    kind = _known_kinds.get(headers.get(CONTENT_KIND_HEADER))
    if version is None or kind is None:
        return None
    retry_count = headers.get(RETRY_COUNT_HEADER, 0)
    if type(retry_count) is not int or not 0 <= retry_count <= _RETRY_MAX:
        return None
    traceparent = headers.get(TRACEPARENT_HEADER)
    tracestate = headers.get(TRACESTATE_HEADER)
    if traceparent is not None and (
        type(traceparent) is not str or len(traceparent) > _TRACEPARENT_BYTES or not valid_traceparent(traceparent)
    ):
        return None
    if tracestate is not None and (type(tracestate) is not str or len(tracestate) > _TRACESTATE_BYTES):
        return None
    return _new_envelope(canonical_uuid(event_text), version, kind, retry_count, traceparent, tracestate)


def validate_envelope(
    headers: Mapping[str, object] | None,
    body_size: int,
    *,
    max_body: int = BOUNDS.queue_body_default,
) -> Envelope:
    """Validate a delivery's headers and body size; return its canonical :class:`Envelope`.

    Checks run in the order of docs/contracts.md section 5: body size (``QUEUE_BODY_TOO_LARGE``),
    metadata bounds (``QUEUE_METADATA_BOUNDS_EXCEEDED``), canonical envelope
    (``QUEUE_ENVELOPE_INVALID``). Raises only :class:`EnvelopeError`.
    """
    if isinstance(body_size, bool) or not isinstance(body_size, int) or body_size < 0:
        raise _invalid(f"body size must be a non-negative integer, got {describe_value(body_size)}")
    if body_size > max_body:
        shown = body_size if body_size.bit_length() <= 64 else describe_value(body_size)
        raise EnvelopeError(ErrorCode.BODY_TOO_LARGE, f"body is {shown} bytes, over the bound of {max_body} bytes")
    if headers is None:
        headers = {}
    elif type(headers) is dict:
        accepted = _accept_common(headers)
        if accepted is not None:
            return accepted
    elif not isinstance(headers, Mapping):
        raise _invalid(f"headers must be a table, got {type(headers).__name__}")
    _check_metadata(headers)

    event_text = _required_str(headers, EVENT_ID_HEADER)
    if not is_canonical_uuid(event_text):
        raise _invalid(
            f"header {EVENT_ID_HEADER!r} must be a canonical lowercase hyphenated non-nil UUID, "
            f"got {describe_value(event_text, 40)}"
        )
    version_text = _required_str(headers, SCHEMA_VERSION_HEADER)
    if _VERSION_RE.fullmatch(version_text) is None or int(version_text) > BOUNDS.schema_version_max:
        raise _invalid(
            f"header {SCHEMA_VERSION_HEADER!r} must be a canonical decimal string "
            f"{BOUNDS.schema_version_min}..{BOUNDS.schema_version_max}, got {describe_value(version_text)}"
        )
    kind = _required_str(headers, CONTENT_KIND_HEADER)
    problem = check_content_kind(kind)
    if problem is not None:
        raise _invalid(f"header {CONTENT_KIND_HEADER!r} {problem}")

    retry_count = _retry_count(headers)
    traceparent = _optional_trace(headers, TRACEPARENT_HEADER, BOUNDS.traceparent_bytes)
    tracestate = _optional_trace(headers, TRACESTATE_HEADER, BOUNDS.tracestate_bytes)
    if traceparent is not None and not valid_traceparent(traceparent):
        # W3C Trace Context: a receiver ignores a malformed traceparent (and its tracestate);
        # both stay bounded above because they are copied on handoff.
        traceparent = None
        tracestate = None
    version = int(version_text)
    if len(_known_versions) < _KNOWN_LIMIT:
        _known_versions[version_text] = version
    if len(_known_kinds) < _KNOWN_LIMIT:
        _known_kinds[kind] = kind
    return _new_envelope(canonical_uuid(event_text), version, kind, retry_count, traceparent, tracestate)


def _retry_count(headers: Mapping[str, object]) -> int:
    """``x-retry-count``: absent is 0; present, an AMQP integer within its bound."""
    value = headers.get(RETRY_COUNT_HEADER)
    if value is None and RETRY_COUNT_HEADER not in headers:
        return 0
    if type(value) is not int:
        # bool is an int subclass in Python but not an AMQP integer here.
        raise _invalid(
            f"header {RETRY_COUNT_HEADER!r} must be an AMQP integer 0..{BOUNDS.retry_count_max}, "
            f"got {describe_value(value)}"
        )
    if not 0 <= value <= BOUNDS.retry_count_max:
        raise _invalid(
            f"header {RETRY_COUNT_HEADER!r} is {describe_value(value)}, outside the bound 0..{BOUNDS.retry_count_max}"
        )
    return value


def sanitize_headers(headers: Mapping[str, object] | None) -> tuple[dict[str, object], int]:
    """The headers that fit every metadata bound on their own, for a handoff copy.

    Used when building retry/DLQ copies (docs/settlement.md section 7): a header that breaks a
    bound (or would push the aggregate past its bound) is dropped rather than
    echoed; returns the kept headers and how many were dropped.
    """
    kept: dict[str, object] = {}
    dropped = 0
    if not isinstance(headers, Mapping):
        return kept, 0
    allowed = BOUNDS.metadata_aggregate_bytes - BOUNDS.handoff_reserve_bytes
    room_entries = BOUNDS.header_entries - _HANDOFF_KEYS_COUNT
    aggregate = 0
    walk = _Walk()
    for key, value in headers.items():
        if key in HANDOFF_HEADER_KEYS and key != RETRY_COUNT_HEADER:
            continue
        if not isinstance(key, str) or not 0 < utf8_len(key) <= BOUNDS.header_key_bytes:
            dropped += 1
            continue
        if key == RETRY_COUNT_HEADER:
            kept[key] = value
            continue
        before = walk.elements
        try:
            size = walk.size(key, value, 0)
        except EnvelopeError:
            walk.elements = before
            dropped += 1
            continue
        if size > BOUNDS.header_value_bytes or aggregate + utf8_len(key) + size > allowed or len(kept) >= room_entries:
            walk.elements = before
            dropped += 1
            continue
        aggregate += utf8_len(key) + size
        kept[key] = value
    return kept, dropped
