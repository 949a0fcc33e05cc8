"""The one home of the hot path's construction tricks: objects built without running ``__init__``.

Three forms, each measured, each held equal to the ordinary construction by a test:

* :func:`slot_constructor` (``benchmarks/bench_throughput.py``): a frozen
  dataclass's ``__init__`` assigns each field through ``object.__setattr__``
  (frozen forbids plain assignment): about 0.25 µs a field on the benchmark's
  machine. Every delivery builds three such objects (its :class:`Envelope`, its
  :class:`RawDelivery` and its :class:`TerminalObservation`, 28 fields in all),
  so the pipeline fills their slots through the slot descriptors instead: the
  same objects, built in a third of the time (about 5 µs a delivery fewer, some
  2 % of the at-least-once consumer's CPU per message). ``tests/unit/test_fast.py``
  holds each constructor equal to the dataclass's own.
* :func:`canonical_uuid`: ``uuid.UUID(text)`` parses the text's form again
  (braces, ``urn:``, hyphens) after the envelope check has already matched the
  canonical form; filling the UUID's two slots takes half the time (0.7 against
  1.5 µs, ``timeit``). ``tests/property/test_envelope_props.py`` compares the two.
* :data:`new_instance` (``object.__new__``): the frame decoding
  (:mod:`lily_mongo._amqp.codec`) builds pamqp's method, properties and header
  objects the way pamqp's own unmarshal fills them: without their ``__init__``
  (which validates its defaults first), every attribute then set.
  ``tests/property/test_frame_decoding_props.py`` compares them with pamqp's.
"""

from __future__ import annotations

import dataclasses
import types
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

__all__ = ["canonical_uuid", "new_instance", "slot_constructor"]

if TYPE_CHECKING:

    def new_instance[T](cls: type[T], /) -> T:
        """An instance of ``cls`` whose ``__init__`` has not run: the caller sets every attribute."""
        ...

else:
    new_instance = object.__new__


def slot_constructor[T](cls: type[T]) -> Callable[..., T]:
    """A positional constructor for the frozen, slotted dataclass ``cls`` that skips ``__init__``.

    The generated function takes every field in order (no defaults, no
    ``__post_init__``): only for classes whose fields need no checks.
    """
    if not dataclasses.is_dataclass(cls) or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__} is not a slotted dataclass")
    cls_any: Any = cls
    if getattr(cls_any, "__post_init__", None) is not None:
        raise TypeError(f"{cls.__name__} has a __post_init__ that this constructor would skip")
    names = [field.name for field in dataclasses.fields(cls_any)]
    namespace: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    for name in names:
        namespace[f"_set_{name}"] = cls.__dict__[name].__set__
    lines = [f"def new_{cls.__name__}({', '.join(names)}):", "    obj = _new(_cls)"]
    lines += [f"    _set_{name}(obj, {name})" for name in names]
    lines.append("    return obj")
    exec("\n".join(lines), namespace)  # the way dataclasses builds __init__
    constructor: Callable[..., T] = namespace[f"new_{cls.__name__}"]
    return constructor


_UUID_SLOTS = (uuid.UUID.__dict__.get("int"), uuid.UUID.__dict__.get("is_safe"))
if all(isinstance(slot, types.MemberDescriptorType) for slot in _UUID_SLOTS):
    _SET_UUID_INT = uuid.UUID.__dict__["int"].__set__
    _SET_UUID_SAFE = uuid.UUID.__dict__["is_safe"].__set__

    def canonical_uuid(text: str) -> uuid.UUID:
        """``uuid.UUID(text)`` for text already matched as canonical, without re-parsing its form."""
        value = new_instance(uuid.UUID)
        _SET_UUID_INT(value, int(text.replace("-", ""), 16))
        _SET_UUID_SAFE(value, uuid.SafeUUID.unknown)
        return value

else:  # pragma: no cover - a Python whose UUID has no such slots

    def canonical_uuid(text: str) -> uuid.UUID:
        """``uuid.UUID(text)``."""
        return uuid.UUID(text)
