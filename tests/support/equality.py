"""Equality of the same types all the way down: what a decoded frame is compared with."""

from __future__ import annotations

import datetime
import decimal
import re
import struct
from typing import Any

_MISSING = object()
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def same(a: Any, b: Any) -> bool:
    """Equal, of the same types all the way down (dict order, slots and ``__dict__`` included)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, BaseException):
        return _ADDRESS.sub("", str(a)) == _ADDRESS.sub("", str(b))  # pamqp's texts name object addresses
    if isinstance(a, float):
        return struct.pack(">d", a) == struct.pack(">d", b)
    if isinstance(a, decimal.Decimal):
        return str(a) == str(b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, str | bytes | bytearray | int | bool | datetime.datetime) or a is None:
        return bool(a == b)
    slots = [name for cls in type(a).__mro__ for name in getattr(cls, "__slots__", ())]
    if any(not same(getattr(a, name, _MISSING), getattr(b, name, _MISSING)) for name in slots):
        return False
    return same(getattr(a, "__dict__", {}), getattr(b, "__dict__", {}))
