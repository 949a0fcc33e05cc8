"""Content contracts: the ``x-lily-content-kind`` token, its MIME type and its encoder (docs/contracts.md section 4).

The built-in tokens ``json``, ``text`` and ``binary`` and their MIME types are
defined here once: the publisher writes them, the AsyncAPI document describes
them. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
import pydantic

from ._checks import check_callable
from ._errors import ConfigError
from ._text import describe_value
from .bounds import utf8_len
from .envelope import check_content_kind

__all__ = ["BINARY", "BUILTIN_CONTENT", "JSON", "TEXT", "CustomPublishContent", "encode_json"]

T = TypeVar("T")


def _json_default(value: object) -> object:
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump(mode="json")
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def encode_json(value: object) -> bytes:
    """Encode a JSON payload with orjson; pydantic models are dumped in JSON mode."""
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump_json().encode()
    try:
        return orjson.dumps(value, default=_json_default)
    except TypeError as exc:  # orjson.JSONEncodeError is a TypeError
        raise ConfigError(f"payload is not JSON serializable: {exc}") from exc


def _encode_text(value: str) -> bytes:
    if not isinstance(value, str):
        raise ConfigError(f"text payload must be a str, got {type(value).__name__}")
    return value.encode("utf-8")


def _encode_binary(value: bytes | bytearray | memoryview) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise ConfigError(f"binary payload must be bytes, got {type(value).__name__}")
    return bytes(value)


@dataclass(frozen=True, slots=True)
class CustomPublishContent[T]:
    """A content contract: the ``x-lily-content-kind`` token, the MIME type and the encoder."""

    kind: str
    content_type: str
    encode: Callable[[T], bytes]

    def __post_init__(self) -> None:
        problem = check_content_kind(self.kind)
        if problem is not None:
            raise ConfigError(f"CustomPublishContent.kind {problem}")
        check_callable("CustomPublishContent.encode", self.encode)
        if not isinstance(self.content_type, str) or not self.content_type or utf8_len(self.content_type) > 255:
            raise ConfigError(
                f"CustomPublishContent.content_type must be 1..255 bytes, got {describe_value(self.content_type)}"
            )


JSON: CustomPublishContent[Any] = CustomPublishContent("json", "application/json", encode_json)
TEXT: CustomPublishContent[str] = CustomPublishContent("text", "text/plain; charset=utf-8", _encode_text)
BINARY: CustomPublishContent[bytes] = CustomPublishContent("binary", "application/octet-stream", _encode_binary)


# The built-in contracts by token.
BUILTIN_CONTENT: Mapping[str, CustomPublishContent[Any]] = {content.kind: content for content in (JSON, TEXT, BINARY)}
