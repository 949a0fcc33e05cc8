"""The one home of the hot path's construction trick (measured by ``benchmarks/bench_throughput.py``).

A frozen dataclass's ``__init__`` assigns each field through ``object.__setattr__``
(frozen forbids plain assignment): about 0.25 µs a field on the benchmark's
machine. Every delivery builds three such objects (its :class:`Envelope`, its
:class:`RawDelivery` and its :class:`TerminalObservation`, 28 fields in all), so
the pipeline fills their slots through the slot descriptors instead: the same
objects, built in a third of the time (about 5 µs a delivery fewer, some 2 % of
the at-least-once consumer's CPU per message). ``tests/unit/test_fast.py`` holds
each constructor equal to the dataclass's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["slot_constructor"]


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
