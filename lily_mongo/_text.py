"""Bounded, sanitized text for reasons, reports and headers.

Nothing unbounded or unprintable that came from the outside is ever echoed:
values are cut to a byte budget and control characters are replaced.
"""

from __future__ import annotations

import errno
import os
import re
import socket

__all__ = ["bind_reason", "describe_key", "describe_value", "sanitize", "truncate_utf8"]

_UNSAFE = re.compile(r"[^\x20-\x7e]")


def truncate_utf8(text: str, max_bytes: int) -> str:
    """Cut ``text`` to at most ``max_bytes`` UTF-8 bytes, never splitting a character."""
    if len(text) <= max_bytes and text.isascii():
        return text
    raw = text.encode("utf-8", "replace")
    if len(raw) <= max_bytes:
        return text
    return raw[: max(0, max_bytes - 3)].decode("utf-8", "ignore") + "..."


def describe_value(value: object, limit: int = 24) -> str:
    """A short, printable description of an untrusted value: its type and a bounded preview."""
    kind = _UNSAFE.sub("?", type(value).__name__[:40])
    if isinstance(value, str | bytes | bytearray):
        size = len(value)
        preview_src = value[: limit + 1]
        preview = preview_src if isinstance(preview_src, str) else bytes(preview_src).decode("latin-1")
        preview = _UNSAFE.sub("?", preview[:limit])
        suffix = "..." if size > limit else ""
        return f"{kind} {preview!r}{suffix} (length {size})"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        # repr() of a huge int is unbounded (and raises past 4300 digits).
        return f"{kind} of {value.bit_length()} bits"
    if isinstance(value, bool | int | float):
        return truncate_utf8(f"{kind} {value!r}", limit + 16)
    return kind


def describe_key(key: str, limit: int = 40) -> str:
    """A bounded, printable rendering of a header key for error reasons."""
    preview = _UNSAFE.sub("?", key[:limit])
    return f"'{preview}'" + ("..." if len(key) > limit else "")


def sanitize(text: str, max_bytes: int) -> str:
    """Printable ASCII only (anything else becomes ``?``), cut to ``max_bytes``: for header values
    built from untrusted text, such as a failure reason."""
    return _UNSAFE.sub("?", text[:max_bytes])


def bind_reason(exc: OSError, host: str) -> str:
    """Why a listening socket on ``host`` could not be opened, in words that say what to change."""
    number = exc.errno
    if number is None and str(exc).startswith("could not bind on any address"):
        number = errno.EADDRNOTAVAIL  # asyncio's create_server drops that errno and says only this
    if number == errno.EADDRINUSE:
        return "address already in use (another process listens there: choose another port)"
    if number == errno.EADDRNOTAVAIL:
        return f"cannot assign requested address ({host} is not an address of this machine)"
    if number == errno.EACCES:
        return "permission denied (ports below 1024 need privileges)"
    if isinstance(exc, socket.gaierror):
        return f"unknown host {host!r}"
    if number is not None:
        return os.strerror(number).lower()
    return str(exc) or type(exc).__name__
