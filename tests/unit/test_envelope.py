"""Example tests for :func:`lily_mongo.envelope.validate_envelope` (docs/contracts.md).

Limits come from the one bounds table (``BOUNDS``); the expected outcome of each
case (accepted, or rejected with which stable code) is stated here on its own,
so a wrong table or a wrong check both make a test fail. Every bound is probed
at the limit (accepted) and one past it (rejected). Sizes are UTF-8 bytes.
"""

from __future__ import annotations

import datetime
import decimal
import uuid

import pytest

from lily_mongo.bounds import BOUNDS
from lily_mongo.envelope import Envelope, EnvelopeError, validate_envelope

# Stable codes (docs/settlement.md), spelled out rather than imported.
INVALID = "QUEUE_ENVELOPE_INVALID"
BOUNDS_EXCEEDED = "QUEUE_METADATA_BOUNDS_EXCEEDED"
BODY_TOO_LARGE = "QUEUE_BODY_TOO_LARGE"

EVENT_ID = "0f8fad5b-d9cb-469f-a165-70867728950e"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

# The headers the framework adds on a retry/DLQ handoff (docs/settlement.md section 7); the
# module keeps room for them in every accepted delivery.
HANDOFF_KEYS = (
    "x-retry-count",
    "x-lily-failure-code",
    "x-lily-failure-reason",
    "x-lily-failed-queue",
    "x-lily-failed-at",
)
HANDOFF_VALUES: dict[str, object] = {
    "x-retry-count": 1,
    "x-lily-failure-code": "QUEUE_HANDLER_FAILED",
    "x-lily-failure-reason": "boom",
    "x-lily-failed-queue": "orders.created",
    "x-lily-failed-at": datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC),
}

# Reasons end up in x-lily-failure-reason and in logs: short and printable.
REASON_MAX_CHARS = 300


def headers(**overrides: object) -> dict[str, object]:
    """A valid canonical envelope; ``overrides`` use ``_`` for ``-`` in header names."""
    table: dict[str, object] = {
        "x-lily-event-id": EVENT_ID,
        "x-lily-schema-version": "1",
        "x-lily-content-kind": "json",
    }
    for name, value in overrides.items():
        table[name.replace("_", "-")] = value
    return table


def accept(table: object, body_size: int = 0, **kwargs: int) -> Envelope:
    envelope = validate_envelope(table, body_size, **kwargs)  # type: ignore[arg-type]
    assert isinstance(envelope, Envelope)
    return envelope


def reject(table: object, code: str, body_size: object = 0, **kwargs: int) -> EnvelopeError:
    with pytest.raises(EnvelopeError) as info:
        validate_envelope(table, body_size, **kwargs)  # type: ignore[arg-type]
    error = info.value
    assert error.code == code, error.reason
    assert isinstance(error.reason, str)
    assert error.reason
    assert len(error.reason) < REASON_MAX_CHARS, error.reason[:200]
    assert error.reason.isprintable()
    return error


def metadata_bytes(table: dict[str, object]) -> int:
    """Key plus value UTF-8 bytes of the non-handoff string headers of ``table``."""
    total = 0
    for key, value in table.items():
        assert isinstance(value, str), "only string values are sized here"
        if key not in HANDOFF_KEYS:
            total += len(key.encode()) + len(value.encode())
    return total


# --- the table itself -----------------------------------------------------------


def test_bounds_table_holds_the_section_4_figures_this_module_checks() -> None:
    # Every other test reads its limit from BOUNDS; this pins those limits to docs/contracts.md
    # section 4 once, so a drifted table cannot pass by moving both sides.
    assert BOUNDS.header_entries == 64
    assert BOUNDS.header_key_bytes == 128
    assert BOUNDS.header_value_bytes == 8 * 1024
    assert BOUNDS.metadata_aggregate_bytes == 32 * 1024
    assert BOUNDS.metadata_depth == 4
    assert BOUNDS.metadata_elements == 256
    assert BOUNDS.traceparent_bytes == 55
    assert BOUNDS.tracestate_bytes == 512
    assert BOUNDS.content_kind_max_bytes == 64
    assert BOUNDS.queue_body_default == 1024 * 1024
    assert BOUNDS.queue_body_max == 16 * 1024 * 1024


# --- the happy path -------------------------------------------------------------


def test_minimal_envelope_is_accepted_with_defaults() -> None:
    envelope = accept(headers())
    assert envelope == Envelope(
        event_id=uuid.UUID(EVENT_ID),
        schema_version=1,
        content_kind="json",
        retry_count=0,
        traceparent=None,
        tracestate=None,
    )


def test_full_envelope_round_trips_every_field() -> None:
    envelope = accept(
        headers(
            x_lily_schema_version="42",
            x_lily_content_kind="vnd.acme+json_v-2",
            x_retry_count=3,
            traceparent=TRACEPARENT,
            tracestate="congo=t61rcWkgMzE,rojo=00f067aa0ba902b7",
        ),
        body_size=512,
    )
    assert envelope.event_id == uuid.UUID(EVENT_ID)
    assert envelope.schema_version == 42
    assert envelope.content_kind == "vnd.acme+json_v-2"
    assert envelope.retry_count == 3
    assert envelope.traceparent == TRACEPARENT
    assert envelope.tracestate == "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


def test_envelope_is_frozen() -> None:
    envelope = accept(headers())
    with pytest.raises(AttributeError):
        envelope.retry_count = 5  # type: ignore[misc]


# --- required headers and the table itself --------------------------------------


@pytest.mark.parametrize("missing", ["x-lily-event-id", "x-lily-schema-version", "x-lily-content-kind"])
def test_missing_required_header_is_invalid(missing: str) -> None:
    table = headers()
    del table[missing]
    error = reject(table, INVALID)
    assert missing in error.reason


@pytest.mark.parametrize("table", [None, {}], ids=["none", "empty"])
def test_no_envelope_headers_is_invalid(table: object) -> None:
    # No "V1/JSON fallback" (docs/contracts.md section 1).
    reject(table, INVALID)


@pytest.mark.parametrize("table", [[("x-lily-event-id", EVENT_ID)], "headers", 7], ids=["list", "str", "int"])
def test_headers_that_are_not_a_table_are_invalid(table: object) -> None:
    reject(table, INVALID)


@pytest.mark.parametrize("key", [b"x-bytes", 7, None, ("x", "y")], ids=["bytes", "int", "none", "tuple"])
def test_header_key_that_is_not_a_string_is_invalid(key: object) -> None:
    table: dict[object, object] = {name: value for name, value in headers().items()}
    table[key] = "v"
    reject(table, INVALID)


@pytest.mark.parametrize(
    "value",
    [object(), {1, 2}, frozenset(), memoryview(b"x"), uuid.UUID(EVENT_ID), 1j],
    ids=["object", "set", "frozenset", "memoryview", "uuid", "complex"],
)
def test_header_value_that_is_not_an_amqp_field_value_is_invalid(value: object) -> None:
    reject(headers(x_custom=value), INVALID)


def test_nested_table_key_that_is_not_a_string_is_invalid() -> None:
    reject(headers(x_custom={1: "one"}), INVALID)


@pytest.mark.parametrize(
    "value",
    [None, True, 7, 1.5, b"raw", bytearray(b"raw"), datetime.datetime(2025, 1, 1), ("a", 1), ["a", {"b": [1]}]],
    ids=["void", "bool", "int", "float", "bytes", "bytearray", "timestamp", "tuple", "nested"],
)
def test_amqp_field_values_in_custom_headers_are_accepted(value: object) -> None:
    accept(headers(x_custom=value))


# --- body size (checked first) --------------------------------------------------


def test_body_at_default_limit_is_accepted() -> None:
    accept(headers(), body_size=BOUNDS.queue_body_default)


def test_body_one_byte_over_default_limit_is_rejected() -> None:
    reject(headers(), BODY_TOO_LARGE, body_size=BOUNDS.queue_body_default + 1)


def test_default_body_limit_is_one_mebibyte() -> None:
    accept(headers(), body_size=1 << 20)
    reject(headers(), BODY_TOO_LARGE, body_size=(1 << 20) + 1)


def test_body_limit_follows_max_body() -> None:
    accept(headers(), body_size=100, max_body=100)
    reject(headers(), BODY_TOO_LARGE, body_size=101, max_body=100)
    accept(headers(), body_size=BOUNDS.queue_body_max, max_body=BOUNDS.queue_body_max)


@pytest.mark.parametrize(
    "table",
    [None, {}, {"x-lily-event-id": "NOT-A-UUID"}, {"x": "y" * (BOUNDS.header_value_bytes + 1)}, ["not", "a", "table"]],
    ids=["none", "empty", "bad-envelope", "bounds", "not-a-table"],
)
def test_body_size_is_checked_before_headers(table: object) -> None:
    # docs/contracts.md section 5, order of checks: body size first.
    reject(table, BODY_TOO_LARGE, body_size=BOUNDS.queue_body_default + 1)


def test_empty_body_is_accepted() -> None:
    accept(headers(), body_size=0)


@pytest.mark.parametrize("body_size", [-1, True, 1.0, "10", None], ids=["negative", "bool", "float", "str", "none"])
def test_body_size_that_is_not_a_non_negative_int_is_rejected(body_size: object) -> None:
    reject(headers(), INVALID, body_size=body_size)


# --- header entries (64, with room for the 5 handoff headers) -------------------


def padded(count: int, *, handoff: tuple[str, ...] = ()) -> dict[str, object]:
    """A valid envelope grown to exactly ``count`` entries, ``handoff`` keys included."""
    table = headers()
    for key in handoff:
        table[key] = HANDOFF_VALUES[key]
    index = 0
    while len(table) < count:
        table[f"x-pad-{index:03d}"] = "v"
        index += 1
    assert len(table) == count
    return table


def test_entries_at_limit_with_room_for_all_handoff_headers_are_accepted() -> None:
    accept(padded(BOUNDS.header_entries - len(HANDOFF_KEYS)))


def test_entries_one_past_the_handoff_reservation_are_rejected() -> None:
    error = reject(padded(BOUNDS.header_entries - len(HANDOFF_KEYS) + 1), BOUNDS_EXCEEDED)
    assert str(BOUNDS.header_entries) in error.reason


def test_handoff_headers_already_present_are_replaced_not_added() -> None:
    # A replayed DLQ copy already carries all five: 64 entries still fit.
    accept(padded(BOUNDS.header_entries, handoff=HANDOFF_KEYS))
    reject(padded(BOUNDS.header_entries + 1, handoff=HANDOFF_KEYS), BOUNDS_EXCEEDED)


def test_one_handoff_header_present_reserves_room_for_the_other_four() -> None:
    handoff = ("x-retry-count",)
    accept(padded(BOUNDS.header_entries - 4, handoff=handoff))
    reject(padded(BOUNDS.header_entries - 3, handoff=handoff), BOUNDS_EXCEEDED)


# --- header key bytes -----------------------------------------------------------


def test_key_at_limit_is_accepted() -> None:
    accept(headers(**{"k" * BOUNDS.header_key_bytes: "v"}))


def test_key_one_byte_over_limit_is_rejected() -> None:
    reject(headers(**{"k" * (BOUNDS.header_key_bytes + 1): "v"}), BOUNDS_EXCEEDED)


def test_key_bound_counts_utf8_bytes_not_characters() -> None:
    two_byte = "\u00e9"  # é: 2 UTF-8 bytes
    at_limit = two_byte * (BOUNDS.header_key_bytes // 2)
    assert len(at_limit.encode()) == BOUNDS.header_key_bytes
    accept(headers(**{at_limit: "v"}))
    # 65 characters, 130 bytes: far below 128 characters, over 128 bytes.
    over = two_byte * (BOUNDS.header_key_bytes // 2 + 1)
    assert len(over) < BOUNDS.header_key_bytes < len(over.encode())
    reject(headers(**{over: "v"}), BOUNDS_EXCEEDED)


def test_empty_key_is_rejected() -> None:
    reject(headers(**{"": "v"}), BOUNDS_EXCEEDED)


# --- header value bytes ---------------------------------------------------------


def test_string_value_at_limit_is_accepted() -> None:
    accept(headers(x_custom="v" * BOUNDS.header_value_bytes))


def test_string_value_one_byte_over_limit_is_rejected() -> None:
    error = reject(headers(x_custom="v" * (BOUNDS.header_value_bytes + 1)), BOUNDS_EXCEEDED)
    assert "x-custom" in error.reason


def test_value_bound_counts_utf8_bytes_not_characters() -> None:
    two_byte = "\u00e9"
    at_limit = two_byte * (BOUNDS.header_value_bytes // 2)  # 4096 chars, 8192 bytes
    accept(headers(x_custom=at_limit))
    over = two_byte * (BOUNDS.header_value_bytes // 2 + 1)  # 4097 chars, 8194 bytes
    assert len(over) < BOUNDS.header_value_bytes < len(over.encode())
    reject(headers(x_custom=over), BOUNDS_EXCEEDED)


def test_four_byte_characters_are_counted_as_four_bytes() -> None:
    emoji = "\U0001f600"
    accept(headers(x_custom=emoji * (BOUNDS.header_value_bytes // 4)))
    reject(headers(x_custom=emoji * (BOUNDS.header_value_bytes // 4) + "v"), BOUNDS_EXCEEDED)


def test_bytes_value_bound() -> None:
    accept(headers(x_custom=b"\xff" * BOUNDS.header_value_bytes))
    reject(headers(x_custom=b"\xff" * (BOUNDS.header_value_bytes + 1)), BOUNDS_EXCEEDED)


def test_nested_value_is_sized_as_a_whole() -> None:
    quarter = BOUNDS.header_value_bytes // 4
    # Well inside: half of the bound in two strings.
    accept(headers(x_custom=["a" * quarter, "b" * quarter]))
    # Every string fits on its own, the array does not.
    reject(headers(x_custom=["a" * (2 * quarter)] * 3), BOUNDS_EXCEEDED)
    reject(headers(x_custom={"k": "a" * (2 * quarter), "l": ["b" * (2 * quarter)] * 2}), BOUNDS_EXCEEDED)


@pytest.mark.parametrize(
    "name", ["x-lily-event-id", "x-lily-schema-version", "x-lily-content-kind", "x-retry-count", "tracestate"]
)
def test_value_bound_applies_to_envelope_headers_too(name: str) -> None:
    reject({**headers(), name: "0" * (BOUNDS.header_value_bytes + 1)}, BOUNDS_EXCEEDED)


# --- aggregate metadata (32 KiB less the 2 KiB handoff reserve) -----------------


def filled_to(target: int) -> dict[str, object]:
    """A valid envelope padded with four headers so its metadata is exactly ``target`` bytes."""
    table = headers()
    keys = [f"x-fill-{index}" for index in range(4)]
    rest = target - metadata_bytes(table) - sum(len(key) for key in keys)
    share, extra = divmod(rest, len(keys))
    for index, key in enumerate(keys):
        table[key] = "a" * (share + (1 if index < extra else 0))
        assert len(table[key]) <= BOUNDS.header_value_bytes  # type: ignore[arg-type]
    assert metadata_bytes(table) == target
    return table


ALLOWED_AGGREGATE = BOUNDS.metadata_aggregate_bytes - BOUNDS.handoff_reserve_bytes


def test_reserve_is_two_kib_of_thirty_two() -> None:
    assert ALLOWED_AGGREGATE == 32 * 1024 - 2 * 1024


def test_aggregate_at_limit_is_accepted() -> None:
    accept(filled_to(ALLOWED_AGGREGATE))


def test_aggregate_one_byte_over_limit_is_rejected() -> None:
    error = reject(filled_to(ALLOWED_AGGREGATE + 1), BOUNDS_EXCEEDED)
    assert str(ALLOWED_AGGREGATE) in error.reason


def test_aggregate_counts_utf8_bytes_not_characters() -> None:
    table = filled_to(ALLOWED_AGGREGATE)
    # Same number of characters, one more byte.
    table["x-fill-0"] = "\u00e9" + table["x-fill-0"][1:]  # type: ignore[index]
    reject(table, BOUNDS_EXCEEDED)


def test_aggregate_counts_keys() -> None:
    table = filled_to(ALLOWED_AGGREGATE)
    value = table.pop("x-fill-0")
    table["x-fill-00"] = value[:-1]  # type: ignore[index]
    accept(table)  # one key byte more, one value byte less
    table["x-fill-000"] = table.pop("x-fill-00")
    reject(table, BOUNDS_EXCEEDED)


def test_handoff_headers_do_not_count_against_the_aggregate() -> None:
    # They are replaced on handoff and are covered by the reserve.
    table = filled_to(ALLOWED_AGGREGATE)
    table.update(HANDOFF_VALUES)
    accept(table)


# --- nesting depth and elements -------------------------------------------------


def nest_lists(levels: int) -> object:
    value: object = "leaf"
    for _ in range(levels):
        value = [value]
    return value


def nest_tables(levels: int) -> object:
    value: object = "leaf"
    for level in range(levels):
        value = {f"k{level}": value}
    return value


def test_nesting_at_depth_limit_is_accepted() -> None:
    accept(headers(x_custom=nest_lists(BOUNDS.metadata_depth)))
    accept(headers(x_custom=nest_tables(BOUNDS.metadata_depth)))


def test_nesting_one_past_depth_limit_is_rejected() -> None:
    reject(headers(x_custom=nest_lists(BOUNDS.metadata_depth + 1)), BOUNDS_EXCEEDED)
    reject(headers(x_custom=nest_tables(BOUNDS.metadata_depth + 1)), BOUNDS_EXCEEDED)


def test_self_referencing_value_is_rejected_not_recursed() -> None:
    loop: list[object] = []
    loop.append(loop)
    reject(headers(x_custom=loop), BOUNDS_EXCEEDED)


def test_depth_limit_is_four() -> None:
    accept(headers(x_custom=[[[["leaf"]]]]))
    reject(headers(x_custom=[[[[["leaf"]]]]]), BOUNDS_EXCEEDED)


def test_elements_at_limit_are_accepted() -> None:
    accept(headers(x_custom=list(range(BOUNDS.metadata_elements))))
    accept(headers(x_custom={f"k{index:03d}": index for index in range(BOUNDS.metadata_elements)}))


def test_elements_one_past_limit_are_rejected() -> None:
    reject(headers(x_custom=list(range(BOUNDS.metadata_elements + 1))), BOUNDS_EXCEEDED)
    reject(
        headers(x_custom={f"k{index:03d}": index for index in range(BOUNDS.metadata_elements + 1)}),
        BOUNDS_EXCEEDED,
    )


def test_elements_are_counted_at_every_level() -> None:
    # Two inner arrays are two elements, plus their own elements.
    half = (BOUNDS.metadata_elements - 2) // 2
    accept(headers(x_custom=[[0] * half, [0] * half]))
    reject(headers(x_custom=[[0] * half, [0] * (half + 1)]), BOUNDS_EXCEEDED)


# --- W3C trace context ----------------------------------------------------------


def test_traceparent_of_55_bytes_is_accepted() -> None:
    assert len(TRACEPARENT.encode()) == BOUNDS.traceparent_bytes
    assert accept(headers(traceparent=TRACEPARENT)).traceparent == TRACEPARENT


def test_traceparent_one_byte_over_is_rejected() -> None:
    error = reject(headers(traceparent=TRACEPARENT + "0"), BOUNDS_EXCEEDED)
    assert "traceparent" in error.reason


def test_traceparent_bound_counts_bytes_not_characters() -> None:
    # 55 characters but 56 bytes.
    value = "\u00e9" + TRACEPARENT[1:]
    assert len(value) == BOUNDS.traceparent_bytes < len(value.encode())
    reject(headers(traceparent=value), BOUNDS_EXCEEDED)


@pytest.mark.parametrize(
    "malformed",
    ["", "garbage", TRACEPARENT.upper(), TRACEPARENT.replace("-", "_"), TRACEPARENT[:-1] + "g"],
    ids=["empty", "garbage", "uppercase", "underscores", "non-hex"],
)
def test_malformed_traceparent_is_ignored_with_its_tracestate(malformed: str) -> None:
    # W3C Trace Context: a receiver that cannot parse traceparent ignores both.
    envelope = accept(headers(traceparent=malformed, tracestate="rojo=00f067aa0ba902b7"))
    assert envelope.traceparent is None
    assert envelope.tracestate is None


def test_traceparent_that_is_not_a_string_is_invalid() -> None:
    reject(headers(traceparent=TRACEPARENT.encode()), INVALID)


def test_tracestate_at_limit_is_accepted() -> None:
    state = "a" * BOUNDS.tracestate_bytes
    assert accept(headers(traceparent=TRACEPARENT, tracestate=state)).tracestate == state


def test_tracestate_one_byte_over_is_rejected() -> None:
    error = reject(headers(traceparent=TRACEPARENT, tracestate="a" * (BOUNDS.tracestate_bytes + 1)), BOUNDS_EXCEEDED)
    assert "tracestate" in error.reason


def test_tracestate_bound_counts_bytes_not_characters() -> None:
    two_byte = "\u00e9"
    accept(headers(traceparent=TRACEPARENT, tracestate=two_byte * (BOUNDS.tracestate_bytes // 2)))
    over = two_byte * (BOUNDS.tracestate_bytes // 2) + "a"
    assert len(over) < BOUNDS.tracestate_bytes < len(over.encode())
    reject(headers(traceparent=TRACEPARENT, tracestate=over), BOUNDS_EXCEEDED)


def test_tracestate_that_is_not_a_string_is_invalid() -> None:
    reject(headers(traceparent=TRACEPARENT, tracestate=5), INVALID)


def test_tracestate_bound_holds_even_when_traceparent_is_malformed() -> None:
    reject(headers(traceparent="garbage", tracestate="a" * (BOUNDS.tracestate_bytes + 1)), BOUNDS_EXCEEDED)


# --- content kind ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kind", ["json", "text", "binary", "0", "a", "vnd.acme+json", "avro_v2", "x-protobuf", "a1.b-c+d_e"]
)
def test_canonical_content_kinds_are_accepted(kind: str) -> None:
    assert accept(headers(x_lily_content_kind=kind)).content_kind == kind


def test_content_kind_at_limit_is_accepted() -> None:
    kind = "k" * BOUNDS.content_kind_max_bytes
    assert accept(headers(x_lily_content_kind=kind)).content_kind == kind


def test_content_kind_one_byte_over_is_rejected() -> None:
    error = reject(headers(x_lily_content_kind="k" * (BOUNDS.content_kind_max_bytes + 1)), INVALID)
    assert "x-lily-content-kind" in error.reason


@pytest.mark.parametrize(
    "kind",
    [
        "",
        "Json",
        "JSON",
        "json\n",
        "\njson",
        " json",
        "json ",
        ".json",
        "-json",
        "_json",
        "+json",
        "application/json",
        "json;v=1",
        "j\u00f6son",  # non-ASCII letter
        "\uff4a\uff53\uff4f\uff4e",  # full-width "json"
        "js on",
        "json\x00",
    ],
)
def test_non_canonical_content_kinds_are_invalid(kind: str) -> None:
    reject(headers(x_lily_content_kind=kind), INVALID)


@pytest.mark.parametrize("kind", [b"json", 1, ["json"]], ids=["bytes", "int", "list"])
def test_content_kind_that_is_not_a_string_is_invalid(kind: object) -> None:
    reject(headers(x_lily_content_kind=kind), INVALID)


# --- schema version -------------------------------------------------------------


@pytest.mark.parametrize(("text", "number"), [("1", 1), ("9", 9), ("10", 10), ("100", 100), ("65535", 65535)])
def test_canonical_schema_versions_are_accepted(text: str, number: int) -> None:
    assert accept(headers(x_lily_schema_version=text)).schema_version == number


def test_schema_version_range_matches_the_table() -> None:
    assert (BOUNDS.schema_version_min, BOUNDS.schema_version_max) == (1, 65535)
    accept(headers(x_lily_schema_version=str(BOUNDS.schema_version_max)))
    reject(headers(x_lily_schema_version=str(BOUNDS.schema_version_max + 1)), INVALID)
    accept(headers(x_lily_schema_version=str(BOUNDS.schema_version_min)))
    reject(headers(x_lily_schema_version=str(BOUNDS.schema_version_min - 1)), INVALID)


@pytest.mark.parametrize(
    "text",
    [
        "01",
        "001",
        "+1",
        "-1",
        " 1",
        "1 ",
        "1.0",
        "1_0",
        "1e3",
        "0x1",
        "\u0663",  # ARABIC-INDIC DIGIT THREE
        "1\u0663",  # an ASCII lead digit, then a non-ASCII digit
        "1\uff11",  # FULLWIDTH DIGIT ONE after an ASCII one
        "\uff11",  # FULLWIDTH DIGIT ONE
        "65536",
        "99999",
        "100000",
        "0",
        "00",
        "",
        "1\n",
        "\t1",
    ],
)
def test_non_canonical_schema_versions_are_invalid(text: str) -> None:
    error = reject(headers(x_lily_schema_version=text), INVALID)
    assert "x-lily-schema-version" in error.reason


@pytest.mark.parametrize(
    "value", [1, 1.0, True, b"1", decimal.Decimal(1)], ids=["int", "float", "bool", "bytes", "decimal"]
)
def test_schema_version_that_is_not_a_string_is_invalid(value: object) -> None:
    # docs/contracts.md section 3: an integer-typed header is invalid.
    reject(headers(x_lily_schema_version=value), INVALID)


# --- event id -------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        EVENT_ID,  # v4
        "6ba7b810-9dad-11d1-80b4-00c04fd430c8",  # v1
        "6fa459ea-ee8a-3ca4-894e-db77e160355e",  # v3
        "886313e1-3b8a-5372-9b90-0c9aee199e5d",  # v5
        "0190163d-8694-739b-aea5-966c26f8ad91",  # v7
        "12345678-1234-0234-c234-123456789abc",  # version nibble 0, odd variant
        "ffffffff-ffff-ffff-ffff-ffffffffffff",  # max UUID: only nil is excluded
        "00000000-0000-0000-0000-000000000001",
    ],
)
def test_canonical_event_ids_of_any_version_are_accepted(text: str) -> None:
    assert accept(headers(x_lily_event_id=text)).event_id == uuid.UUID(text)


@pytest.mark.parametrize(
    "text",
    [
        EVENT_ID.upper(),
        EVENT_ID[:-1] + "E",  # one uppercase hex digit
        "{" + EVENT_ID + "}",
        EVENT_ID.replace("-", ""),
        "urn:uuid:" + EVENT_ID,
        "00000000-0000-0000-0000-000000000000",  # nil
        EVENT_ID + "\n",
        " " + EVENT_ID,
        EVENT_ID + " ",
        EVENT_ID[:-1],
        EVENT_ID + "0",
        EVENT_ID[:-1] + "g",
        "0f8fad5bd-9cb-469f-a165-70867728950e",  # hyphens misplaced
        EVENT_ID.replace("-", "_"),
        "",
    ],
)
def test_non_canonical_event_ids_are_invalid(text: str) -> None:
    error = reject(headers(x_lily_event_id=text), INVALID)
    assert "x-lily-event-id" in error.reason


@pytest.mark.parametrize(
    "value", [uuid.UUID(EVENT_ID), EVENT_ID.encode(), uuid.UUID(EVENT_ID).int], ids=["uuid", "bytes", "int"]
)
def test_event_id_that_is_not_a_string_is_invalid(value: object) -> None:
    reject(headers(x_lily_event_id=value), INVALID)


# --- x-retry-count --------------------------------------------------------------


def test_absent_retry_count_means_zero() -> None:
    assert accept(headers()).retry_count == 0


@pytest.mark.parametrize("count", [0, 1, 50, 100])
def test_retry_count_in_range_is_accepted(count: int) -> None:
    assert accept(headers(x_retry_count=count)).retry_count == count


def test_retry_count_limit_matches_the_table() -> None:
    assert BOUNDS.retry_count_max == 100
    accept(headers(x_retry_count=BOUNDS.retry_count_max))
    reject(headers(x_retry_count=BOUNDS.retry_count_max + 1), INVALID)


@pytest.mark.parametrize(
    "value",
    [101, -1, 2**31, -(2**63), "1", "0", 1.0, 0.0, True, False, None, b"\x01", [1]],
    ids=repr,
)
def test_retry_count_that_is_not_an_int_in_range_is_invalid(value: object) -> None:
    error = reject(headers(x_retry_count=value), INVALID)
    assert "x-retry-count" in error.reason


# --- reasons are bounded and sanitized ------------------------------------------

HUGE = "Z" * 1_000_000
NEEDLE = "Z" * 64  # any echo of the huge value would contain this


@pytest.mark.parametrize(
    "table",
    [
        headers(x_custom=HUGE),
        headers(x_lily_event_id=HUGE),
        headers(x_lily_schema_version=HUGE),
        headers(x_lily_content_kind=HUGE),
        headers(traceparent=HUGE),
        headers(x_custom=[HUGE]),
        headers(x_custom={"k": HUGE}),
        headers(x_custom=HUGE.encode()),
        headers(**{HUGE: "v"}),
    ],
    ids=["custom", "event-id", "version", "content-kind", "traceparent", "in-list", "in-table", "bytes", "key"],
)
def test_huge_raw_values_are_never_echoed(table: dict[str, object]) -> None:
    error = reject(table, BOUNDS_EXCEEDED)
    assert NEEDLE not in error.reason
    assert NEEDLE not in str(error)


@pytest.mark.parametrize("name", ["x-lily-event-id", "x-lily-schema-version", "x-lily-content-kind", "x-retry-count"])
def test_invalid_values_inside_the_value_bound_are_not_echoed_whole(name: str) -> None:
    # Within 8 KiB, so it reaches the envelope checks: the reason previews at most a few dozen chars.
    value = "Z" * (BOUNDS.header_value_bytes - 100)
    error = reject({**headers(), name: value}, INVALID)
    assert NEEDLE not in error.reason
    assert name in error.reason


@pytest.mark.parametrize("name", ["x-lily-event-id", "x-lily-schema-version", "x-lily-content-kind", "x-retry-count"])
def test_control_characters_are_not_echoed(name: str) -> None:
    value = "\x1b[31m\x00\r\nInjected: yes\u202e"
    error = reject({**headers(), name: value}, INVALID)
    for unsafe in ("\x1b", "\x00", "\r", "\n", "\u202e"):
        assert unsafe not in error.reason


@pytest.mark.parametrize("name", ["x-retry-count", "x-lily-schema-version", "x-lily-event-id"])
def test_huge_int_header_raises_only_envelope_error(name: str) -> None:
    reject({**headers(), name: 10**5000}, INVALID)


@pytest.mark.parametrize("body_size", [10**5000, -(10**5000)], ids=["huge", "huge-negative"])
def test_huge_body_size_raises_only_envelope_error(body_size: int) -> None:
    with pytest.raises(EnvelopeError):
        validate_envelope(headers(), body_size)


def test_out_of_range_retry_count_is_not_echoed_whole() -> None:
    reject(headers(x_retry_count=10**4000), INVALID)
