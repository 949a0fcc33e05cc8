"""Wire encoding of the header table: ``x-retry-count`` is always AMQP LongInt (type tag ``I``)."""

from __future__ import annotations

import pytest
from pamqp import commands as spec
from pamqp import decode

from lily_mongo._amqp import LilyProperties, encode_headers_table


def test_retry_count_is_long_int_and_other_integers_keep_pamqp_defaults() -> None:
    wire = LilyProperties(headers={"x-retry-count": 3, "other": 3}).marshal()
    assert b"\x0dx-retry-countI\x00\x00\x00\x03" in wire
    assert b"\x05otherb\x03" in wire  # pamqp's narrowest integer (short-short int) for every other key


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (0, b"I\x00\x00\x00\x00"),
        (1, b"I\x00\x00\x00\x01"),
        (100, b"I\x00\x00\x00\x64"),
        (70000, b"I\x00\x01\x11\x70"),
    ],
)
def test_retry_count_values(value: int, encoded: bytes) -> None:
    wire = LilyProperties(headers={"x-retry-count": value}).marshal()
    assert b"\x0dx-retry-count" + encoded in wire


def test_plain_pamqp_properties_are_untouched() -> None:
    # Other publishers in the process still get pamqp's own choice.
    wire = spec.Basic.Properties(headers={"x-retry-count": 3}).marshal()
    assert b"\x0dx-retry-countb\x03" in wire
    assert b"\x0dx-retry-countI" not in wire


def test_the_table_decodes_back_to_the_same_headers() -> None:
    headers = {
        "x-retry-count": 2,
        "x-lily-event-id": "0f8fad5b-d9cb-469f-a165-70867728950e",
        "nested": {"a": 1, "b": ["x", 2]},
        "flag": True,
    }
    raw = encode_headers_table(headers)
    consumed, decoded = decode.field_table(raw)
    assert consumed == len(raw)
    assert decoded == headers
    assert type(decoded["x-retry-count"]) is int


def test_empty_table() -> None:
    assert encode_headers_table({}) == b"\x00\x00\x00\x00"
