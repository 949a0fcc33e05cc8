"""The properties lily writes on a message, and their header table's encoding (docs/contracts.md).

:class:`LilyProperties` encodes ``x-retry-count`` as AMQP LongInt (type tag ``I``) whatever its
value. pamqp picks the narrowest integer type for table values (``b`` for 0..127) and offers no
per-value choice; overriding the header table encoding on this one properties subclass keeps
every other value, and every other publisher in the process, on pamqp's defaults. Published
messages and received ones (the frame readers build their properties as this class) share it.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

from pamqp import commands as spec
from pamqp import common, encode

from .._headers import RETRY_COUNT_HEADER

__all__ = ["LONG_INT_HEADERS", "LilyProperties", "encode_headers_table"]


# Headers always written as signed 32-bit LongInt (docs/contracts.md, x-retry-count).
LONG_INT_HEADERS: frozenset[str] = frozenset({RETRY_COUNT_HEADER})
_LONG_INT = struct.Struct(">i")


def _field_value(value: Any) -> Any:
    """pamqp encodes byte arrays from ``bytearray`` only; ``bytes`` (what MongoDB and most
    callers hand back) becomes a byte array too, nested values included."""
    if isinstance(value, bytes):
        return bytearray(value)
    if isinstance(value, dict):
        return {k: _field_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_field_value(v) for v in value]
    return value


def encode_headers_table(headers: Mapping[str, Any]) -> bytes:
    """Encode an AMQP field table like pamqp does, but LongInt for :data:`LONG_INT_HEADERS`."""
    if not headers:
        return common.Struct.integer.pack(0)
    parts: list[bytes] = []
    for key, value in sorted(headers.items()):
        parts.append(encode.short_string(key))
        if key in LONG_INT_HEADERS and type(value) is int:
            parts.append(b"I" + _LONG_INT.pack(value))
        elif isinstance(value, bytes | dict | list | tuple):
            parts.append(encode.encode_table_value(_field_value(value)))
        else:
            parts.append(encode.encode_table_value(value))
    payload = b"".join(parts)
    return common.Struct.integer.pack(len(payload)) + payload


class LilyProperties(spec.Basic.Properties):
    """Basic.Properties whose header table writes ``x-retry-count`` as LongInt."""

    def encode_property(self, name: str, value: common.FieldValue) -> bytes:
        if name == "headers" and isinstance(value, dict):
            return encode_headers_table(value)
        return super().encode_property(name, value)
