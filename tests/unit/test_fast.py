"""The hot path's slot-filling constructors build the very objects the dataclasses build."""

from __future__ import annotations

import dataclasses
import uuid
from types import MappingProxyType

import pytest

from lily_mongo._fast import slot_constructor
from lily_mongo._plan.extractors import RawDelivery, new_raw_delivery
from lily_mongo._snapshots import TerminalObservation
from lily_mongo.envelope import Envelope, validate_envelope


def test_each_constructor_builds_what_the_dataclass_builds() -> None:
    event = uuid.uuid4()
    envelope_fields = (event, 3, "json", 2, None, "k=v")
    assert slot_constructor(Envelope)(*envelope_fields) == Envelope(*envelope_fields)
    envelope = Envelope(*envelope_fields)
    delivery_fields = ("q", MappingProxyType({"a": 1}), b"{}", "application/json", True, envelope, "rk", "ex")
    built = new_raw_delivery(*delivery_fields)
    assert built == RawDelivery(*delivery_fields)
    assert type(built) is RawDelivery
    observation = ("q", "h", event, "acked", None, "", False, True, False, 1, 0, 0, 1.5, 0.25)
    assert slot_constructor(TerminalObservation)(*observation) == TerminalObservation(*observation)


def test_the_built_objects_stay_frozen() -> None:
    envelope = slot_constructor(Envelope)(uuid.uuid4(), 1, "json", 0, None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        envelope.retry_count = 5  # type: ignore[misc]


def test_the_envelope_validator_returns_the_same_value_as_the_dataclass() -> None:
    event = uuid.uuid4()
    headers = {"x-lily-event-id": str(event), "x-lily-schema-version": "7", "x-lily-content-kind": "json"}
    assert validate_envelope(headers, 2) == Envelope(event, 7, "json", 0, None, None)


def test_classes_it_cannot_serve_are_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Unslotted:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class Checked:
        a: int

        def __post_init__(self) -> None:
            if self.a < 0:
                raise ValueError("a")

    with pytest.raises(TypeError, match="slotted"):
        slot_constructor(Unslotted)
    with pytest.raises(TypeError, match="__post_init__"):
        slot_constructor(Checked)
