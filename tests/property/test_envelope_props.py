"""Hypothesis properties of :func:`lily_mongo.envelope.validate_envelope` (docs/contracts.md).

1. Total: on any input it returns an ``Envelope`` or raises ``EnvelopeError`` with
   a stable code and a bounded, printable reason; nothing else escapes.
2. Every canonical form is accepted and round-trips into the ``Envelope``.
3. Generated non-canonical forms of the same values are rejected.
"""

from __future__ import annotations

import re
import types
import uuid
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lily_mongo import envelope as envelope_module
from lily_mongo._fast import canonical_uuid
from lily_mongo.bounds import BOUNDS
from lily_mongo.envelope import Envelope, EnvelopeError, validate_envelope

INVALID = "QUEUE_ENVELOPE_INVALID"
BOUNDS_EXCEEDED = "QUEUE_METADATA_BOUNDS_EXCEEDED"
BODY_TOO_LARGE = "QUEUE_BODY_TOO_LARGE"
CODES = {INVALID, BOUNDS_EXCEEDED, BODY_TOO_LARGE}

# A reason may quote a header key (<= 128 bytes, up to 4 repr characters per
# byte), so this ceiling is loose on purpose; the unit tests pin the tight bound
# for ordinary keys. What it catches is an echo of an unbounded value.
REASON_CEILING = 1024

# No example database: the run leaves no files behind and stays a few seconds.
FAST = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

EVENT_ID = "0f8fad5b-d9cb-469f-a165-70867728950e"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
ENVELOPE_KEYS = [
    "x-lily-event-id",
    "x-lily-schema-version",
    "x-lily-content-kind",
    "x-retry-count",
    "traceparent",
    "tracestate",
    "x-lily-failure-code",
    "x-lily-failure-reason",
    "x-lily-failed-queue",
    "x-lily-failed-at",
]
CONTENT_KIND_PATTERN = r"[a-z0-9][a-z0-9._+-]{0,63}"
CONTENT_KIND_ALLOWED = frozenset("abcdefghijklmnopqrstuvwxyz0123456789._+-")


def valid_headers() -> dict[str, object]:
    return {"x-lily-event-id": EVENT_ID, "x-lily-schema-version": "1", "x-lily-content-kind": "json"}


def check_total(table: object, body_size: object, max_body: int | None = None) -> Envelope | EnvelopeError:
    """Run the validator and assert the error contract; return what it produced."""
    kwargs = {} if max_body is None else {"max_body": max_body}
    try:
        return validate_envelope(table, body_size, **kwargs)  # type: ignore[arg-type]
    except EnvelopeError as caught:
        error = caught
    assert error.code in CODES
    assert isinstance(error.reason, str)
    assert error.reason
    assert len(error.reason) <= REASON_CEILING, error.reason[:200]
    assert error.reason.isprintable(), ascii(error.reason[:200])
    return error


def rejected_code(table: dict[str, object]) -> str:
    outcome = check_total(table, 0)
    assert isinstance(outcome, EnvelopeError), f"accepted {table!r:.200}"
    return outcome.code


# --- 1. arbitrary input never raises anything but EnvelopeError -----------------


class Opaque:
    """A value no AMQP codec knows."""


huge_strings = st.sampled_from(["Z" * 1_000_000, "\u00e9" * 5000, "a" * (BOUNDS.header_value_bytes + 1)])
sized_strings = st.integers(0, 3 * BOUNDS.header_value_bytes).map(lambda n: "v" * n)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.decimals(allow_nan=True),
    st.datetimes(),
    st.text(max_size=64),
    st.binary(max_size=64),
    st.builds(bytearray, st.binary(max_size=16)),
    huge_strings,
    sized_strings,
    st.builds(Opaque),
    st.builds(object),
    st.uuids(),
    st.complex_numbers(),
    st.sampled_from([EVENT_ID, "1", "65535", "json", TRACEPARENT, 0, 100, 101, -1, True, 1.0]),
)

field_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=8),
        st.tuples(inner, inner),
        st.dictionaries(st.one_of(st.text(max_size=16), st.integers(), st.none()), inner, max_size=8),
        st.frozensets(st.integers(), max_size=4),
        st.integers(0, 300).map(lambda n: list(range(n))),
        # Deep chains, past the depth bound.
        st.integers(0, 10).map(lambda depth: _chain(depth)),
    ),
    max_leaves=24,
)


def _chain(depth: int) -> object:
    value: object = "leaf"
    for _ in range(depth):
        value = [value]
    return value


header_keys = st.one_of(
    st.sampled_from(ENVELOPE_KEYS),
    st.text(max_size=140),
    st.integers(0, 200).map(lambda n: "k" * n),
    st.binary(max_size=16),
    st.integers(),
    st.none(),
    st.floats(allow_nan=False),
    st.tuples(st.integers(), st.text(max_size=4)),
    st.sampled_from(["Z" * 1_000_000]),
)

body_sizes = st.one_of(
    st.integers(-10, 2 * BOUNDS.queue_body_default),
    st.integers(-(2**70), 2**70),
    st.sampled_from([BOUNDS.queue_body_default, BOUNDS.queue_body_default + 1]),
    st.booleans(),
    st.none(),
    st.floats(),
    st.text(max_size=8),
)


@FUZZ
@given(
    table=st.one_of(
        st.dictionaries(header_keys, field_values, max_size=12),
        # Around the entry bound (64, less room for 5 handoff headers).
        st.dictionaries(
            st.one_of(st.sampled_from(ENVELOPE_KEYS), st.text(min_size=1, max_size=6)),
            st.sampled_from(["v", 1, None, EVENT_ID]),
            min_size=55,
            max_size=70,
        ),
        st.none(),
        st.lists(st.text(max_size=8), max_size=4),
        st.text(max_size=8),
        st.integers(),
    ),
    body_size=body_sizes,
)
def test_arbitrary_input_raises_only_envelope_error(table: object, body_size: object) -> None:
    check_total(table, body_size)


@FUZZ
@given(
    overrides=st.dictionaries(header_keys, field_values, max_size=8),
    removed=st.sets(st.sampled_from(ENVELOPE_KEYS[:3]), max_size=1),
    body_size=body_sizes,
    max_body=st.integers(0, BOUNDS.queue_body_max),
)
def test_arbitrary_changes_to_a_valid_envelope_raise_only_envelope_error(
    overrides: dict[object, object], removed: set[str], body_size: object, max_body: int
) -> None:
    # Start from a valid envelope so the later checks (envelope, retry, trace) are reached.
    table: dict[object, object] = {name: value for name, value in valid_headers().items()}
    table.update(overrides)
    for key in removed:
        table.pop(key, None)
    outcome = check_total(table, body_size, max_body)
    if type(body_size) is int and body_size > max_body and isinstance(outcome, EnvelopeError) and body_size >= 0:
        # The body bound is checked before anything in the headers.
        assert outcome.code == BODY_TOO_LARGE


@FAST
@given(overrides=st.dictionaries(st.sampled_from(ENVELOPE_KEYS), field_values, max_size=6))
def test_arbitrary_envelope_header_values_raise_only_envelope_error(overrides: dict[str, object]) -> None:
    check_total({**valid_headers(), **overrides}, 0)


# --- 2. canonical forms are accepted and round-trip -----------------------------

canonical_uuids = st.uuids().filter(lambda value: value.int != 0)
canonical_kinds = st.from_regex(CONTENT_KIND_PATTERN, fullmatch=True)
versions = st.integers(BOUNDS.schema_version_min, BOUNDS.schema_version_max)
retry_counts = st.integers(0, BOUNDS.retry_count_max)


@FAST
@given(
    event_id=canonical_uuids,
    version=versions,
    kind=canonical_kinds,
    retry=st.one_of(st.none(), retry_counts),
    traced=st.booleans(),
)
def test_canonical_envelopes_are_accepted_and_round_trip(
    event_id: uuid.UUID, version: int, kind: str, retry: int | None, traced: bool
) -> None:
    table: dict[str, object] = {
        "x-lily-event-id": str(event_id).lower(),
        "x-lily-schema-version": str(version),
        "x-lily-content-kind": kind,
    }
    if retry is not None:
        table["x-retry-count"] = retry
    if traced:
        table["traceparent"] = TRACEPARENT
        table["tracestate"] = "rojo=00f067aa0ba902b7"
    envelope = validate_envelope(table, 0)
    assert envelope.event_id == event_id
    assert envelope.schema_version == version
    assert envelope.content_kind == kind
    assert envelope.retry_count == (0 if retry is None else retry)
    assert envelope.traceparent == (TRACEPARENT if traced else None)
    assert envelope.tracestate == ("rojo=00f067aa0ba902b7" if traced else None)


@FAST
@given(version=st.sampled_from([1, 2, 3, 4, 5]), event_id=st.data())
def test_every_uuid_version_is_accepted(version: int, event_id: st.DataObject) -> None:
    value = event_id.draw(st.uuids(version=version))  # type: ignore[arg-type]
    assert validate_envelope({**valid_headers(), "x-lily-event-id": str(value)}, 0).event_id == value


# --- 3. non-canonical forms are rejected -----------------------------------------

uuid_spoilers: list[Callable[[str], str]] = [
    str.upper,
    lambda text: "{" + text + "}",
    lambda text: text.replace("-", ""),
    lambda text: "urn:uuid:" + text,
    lambda text: text + "\n",
    lambda text: " " + text,
    lambda text: text[:-1],
    lambda text: text + "0",
    lambda text: text.replace("-", "_", 1),
]


@FAST
@given(event_id=canonical_uuids, spoil=st.sampled_from(uuid_spoilers))
def test_non_canonical_uuid_text_is_rejected(event_id: uuid.UUID, spoil: Callable[[str], str]) -> None:
    text = spoil(str(event_id))
    if text == str(event_id):  # an all-digit UUID has no case to change
        return
    assert rejected_code({**valid_headers(), "x-lily-event-id": text}) == INVALID


@FAST
@given(event_id=canonical_uuids.filter(lambda value: re.search("[a-f]", str(value)) is not None), data=st.data())
def test_uuid_with_any_uppercase_hex_digit_is_rejected(event_id: uuid.UUID, data: st.DataObject) -> None:
    text = str(event_id)
    letters = [index for index, char in enumerate(text) if char in "abcdef"]
    index = data.draw(st.sampled_from(letters))
    mixed = text[:index] + text[index].upper() + text[index + 1 :]
    assert rejected_code({**valid_headers(), "x-lily-event-id": mixed}) == INVALID


ARABIC_INDIC = str.maketrans("0123456789", "\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669")
FULL_WIDTH = str.maketrans("0123456789", "\uff10\uff11\uff12\uff13\uff14\uff15\uff16\uff17\uff18\uff19")


@FAST
@given(
    version=versions,
    zeros=st.integers(1, 3),
    form=st.sampled_from(
        [
            "zeros",
            "plus",
            "lead-space",
            "trail-space",
            "newline",
            "dot",
            "arabic",
            "full-width",
            "ascii-then-arabic",
            "int",
            "minus",
        ]
    ),
)
def test_non_canonical_version_text_is_rejected(version: int, zeros: int, form: str) -> None:
    text = str(version)
    spoiled: object = {
        "zeros": "0" * zeros + text,
        "plus": "+" + text,
        "lead-space": " " + text,
        "trail-space": text + " ",
        "newline": text + "\n",
        "dot": text + ".0",
        "arabic": text.translate(ARABIC_INDIC),
        "full-width": text.translate(FULL_WIDTH),
        # Python's int() accepts any Unicode digit; "1\u0663" would read as 13.
        "ascii-then-arabic": text[0] + (text[1:] or "0").translate(ARABIC_INDIC),
        "int": version,
        "minus": "-" + text,
    }[form]
    assert rejected_code({**valid_headers(), "x-lily-schema-version": spoiled}) == INVALID


@FAST
@given(version=st.integers(10, BOUNDS.schema_version_max), data=st.data())
def test_version_with_an_underscore_is_rejected(version: int, data: st.DataObject) -> None:
    text = str(version)
    cut = data.draw(st.integers(1, len(text) - 1))
    spoiled = text[:cut] + "_" + text[cut:]
    assert int(spoiled) == version  # Python's int() would accept it
    assert rejected_code({**valid_headers(), "x-lily-schema-version": spoiled}) == INVALID


@FAST
@given(version=st.one_of(st.integers(BOUNDS.schema_version_max + 1, 10**12), st.integers(-(10**6), 0)))
def test_version_out_of_range_is_rejected(version: int) -> None:
    assert rejected_code({**valid_headers(), "x-lily-schema-version": str(version)}) == INVALID


disallowed_chars = st.characters().filter(lambda char: char not in CONTENT_KIND_ALLOWED)


@FAST
@given(kind=canonical_kinds, data=st.data())
def test_content_kind_with_an_uppercase_letter_is_rejected(kind: str, data: st.DataObject) -> None:
    index = data.draw(st.integers(0, len(kind) - 1))
    upper = data.draw(st.sampled_from("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    spoiled = kind[:index] + upper + kind[index + 1 :]
    assert rejected_code({**valid_headers(), "x-lily-content-kind": spoiled}) == INVALID


@FAST
@given(kind=canonical_kinds, char=disallowed_chars, data=st.data())
def test_content_kind_with_a_disallowed_character_is_rejected(kind: str, char: str, data: st.DataObject) -> None:
    index = data.draw(st.integers(0, len(kind)))
    spoiled = kind[:index] + char + kind[index:]
    assert rejected_code({**valid_headers(), "x-lily-content-kind": spoiled}) == INVALID


@FAST
@given(kind=canonical_kinds, lead=st.sampled_from("._+-"))
def test_content_kind_starting_with_punctuation_is_rejected(kind: str, lead: str) -> None:
    assert rejected_code({**valid_headers(), "x-lily-content-kind": lead + kind[:63]}) == INVALID


@FAST
@given(kind=canonical_kinds, extra=st.integers(1, 200))
def test_content_kind_over_64_bytes_is_rejected(kind: str, extra: int) -> None:
    too_long = kind + "k" * (BOUNDS.content_kind_max_bytes + extra - len(kind))
    assert len(too_long) > BOUNDS.content_kind_max_bytes
    assert rejected_code({**valid_headers(), "x-lily-content-kind": too_long}) == INVALID


@FAST
@given(
    value=st.one_of(
        st.integers().filter(lambda n: not 0 <= n <= BOUNDS.retry_count_max).filter(lambda n: abs(n) < 10**100),
        retry_counts.map(str),
        retry_counts.map(float),
        st.booleans(),
        st.none(),
        st.floats(),
        st.binary(max_size=4),
    )
)
def test_retry_count_that_is_not_an_int_in_range_is_rejected(value: object) -> None:
    assert rejected_code({**valid_headers(), "x-retry-count": value}) == INVALID


# --- bytes, not characters --------------------------------------------------------


def accepted_within(outcome: Envelope | EnvelopeError, within: bool, code: str) -> None:
    """Accepted when the input is ``within`` its bound, else refused with ``code``."""
    if within:
        assert isinstance(outcome, Envelope)
    else:
        assert isinstance(outcome, EnvelopeError)
        assert outcome.code == code


@FAST
@given(
    char=st.sampled_from(["a", "\u00e9", "\u20ac", "\U0001f600"]),
    count=st.integers(BOUNDS.header_value_bytes // 4 - 8, BOUNDS.header_value_bytes + 8),
)
def test_value_bound_is_in_utf8_bytes(char: str, count: int) -> None:
    value = char * count
    outcome = check_total({**valid_headers(), "x-custom": value}, 0)
    accepted_within(outcome, len(value.encode("utf-8")) <= BOUNDS.header_value_bytes, BOUNDS_EXCEEDED)


@FAST
@given(
    char=st.sampled_from(["a", "\u00e9", "\u20ac", "\U0001f600"]),
    count=st.integers(1, BOUNDS.header_key_bytes + 4),
)
def test_key_bound_is_in_utf8_bytes(char: str, count: int) -> None:
    key = char * count
    outcome = check_total({**valid_headers(), key: "v"}, 0)
    accepted_within(outcome, len(key.encode("utf-8")) <= BOUNDS.header_key_bytes, BOUNDS_EXCEEDED)


@FAST
@given(body_size=st.integers(0, 4 * BOUNDS.queue_body_default), max_body=st.integers(0, 2 * BOUNDS.queue_body_default))
def test_body_bound(body_size: int, max_body: int) -> None:
    accepted_within(check_total(valid_headers(), body_size, max_body), body_size <= max_body, BODY_TOO_LARGE)


# -- the accept-only fast path agrees with the full checks ------------------------------------------

# Few versions and kinds, so the full path has seen (and remembered) them when the fast path runs.
KNOWN_VERSIONS = ["1", "2", "65535"]
KNOWN_KINDS = ["json", "text", "application.x+y-z"]
near_canonical_values = st.one_of(
    st.sampled_from([*KNOWN_VERSIONS, *KNOWN_KINDS, "01", "0", "65536", "JSON", "", " 1", "1\n"]),
    st.sampled_from([EVENT_ID, EVENT_ID.upper(), "00000000-0000-0000-0000-000000000000", EVENT_ID + "\n"]),
    st.sampled_from([TRACEPARENT, "ff" + TRACEPARENT[2:], TRACEPARENT[:3] + "0" * 32 + TRACEPARENT[35:]]),
    st.sampled_from([TRACEPARENT[:36] + "0" * 16 + "-01", TRACEPARENT.upper(), TRACEPARENT + "x"]),
    st.integers(-(2**64), 2**64),
    st.sampled_from([0, 100, 101, -1, True, False, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1]),
    st.text(max_size=64),
    st.text(alphabet="ab", min_size=BOUNDS.header_value_bytes - 1, max_size=BOUNDS.header_value_bytes + 1),
    field_values,
)
filler_keys = st.one_of(
    st.text(max_size=12),
    st.integers(BOUNDS.header_key_bytes - 1, BOUNDS.header_key_bytes + 1).map(lambda n: "k" * n),
    st.sampled_from(["", "\u00e9t\u00e9", "x-delivery-count"]),
)


# Values right at each bound the fast path checks.
boundary_headers = st.sampled_from(
    [
        ("x-retry-count", 100),
        ("x-retry-count", 101),
        ("x-retry-count", -1),
        ("x-retry-count", True),
        ("x-retry-count", "1"),
        ("x-retry-count", None),
        ("x-lily-event-id", "00000000-0000-0000-0000-000000000000"),
        ("x-lily-event-id", EVENT_ID.upper()),
        ("x-lily-event-id", 7),
        ("x-lily-schema-version", "01"),
        ("x-lily-schema-version", "70000"),
        ("x-lily-schema-version", 1),
        ("x-lily-content-kind", "JSON"),
        ("x-lily-content-kind", ""),
        ("x-lily-content-kind", 1),
        ("traceparent", TRACEPARENT),
        ("traceparent", "ff" + TRACEPARENT[2:]),
        ("traceparent", TRACEPARENT + "0"),
        ("traceparent", 5),
        ("tracestate", "t" * BOUNDS.tracestate_bytes),
        ("tracestate", "t" * (BOUNDS.tracestate_bytes + 1)),
        ("tracestate", 5),
        ("big", 2**63 - 1),
        ("big", 2**63),
        ("big", -(2**63)),
        ("big", -(2**63) - 1),
        ("k" * BOUNDS.header_key_bytes, "v"),
        ("k" * (BOUNDS.header_key_bytes + 1), "v"),
        ("", "v"),
        ("\u00e9" * (BOUNDS.header_key_bytes // 2), "v"),
        ("\u00e9" * (BOUNDS.header_key_bytes // 2 + 1), "v"),
        ("\u00e9t\u00e9", "v"),
        ("v", "\u00e9t\u00e9"),
        ("v", "v" * BOUNDS.header_value_bytes),
        ("v", "v" * (BOUNDS.header_value_bytes + 1)),
        ("v", "\u00e9" * (BOUNDS.header_value_bytes // 2)),
        ("v", "\u00e9" * (BOUNDS.header_value_bytes // 2 + 1)),
        ("x-lily-failure-code", "X"),
        ("v", 1.5),
        ("v", b"bytes"),
    ]
)


# Each ingredient is often absent, so most examples differ from a valid table in one respect only.
def sometimes(strategy: st.SearchStrategy[Any], absent: Any) -> st.SearchStrategy[Any]:
    return st.one_of(st.just(absent), st.just(absent), strategy)


@settings(FUZZ, max_examples=1000)
@given(
    event_id=canonical_uuids,
    version=st.sampled_from(KNOWN_VERSIONS),
    kind=st.sampled_from(KNOWN_KINDS),
    boundary=st.lists(boundary_headers, max_size=2),
    overrides=sometimes(st.dictionaries(st.sampled_from(ENVELOPE_KEYS), near_canonical_values, max_size=2), {}),
    extra=sometimes(st.dictionaries(filler_keys, near_canonical_values, max_size=4), {}),
    entries=sometimes(st.sampled_from([3, 54, 55, 56, 57, 58, 59, 60, 61]), 0),
    bulk=sometimes(st.sampled_from([7_000, 7_600, 7_640, 7_650, 7_660, 7_680]), 0),
)
def test_fast_path_agrees_with_the_full_checks(
    event_id: uuid.UUID,
    version: str,
    kind: str,
    boundary: list[tuple[str, object]],
    overrides: dict[str, object],
    extra: dict[str, object],
    entries: int,
    bulk: int,
) -> None:
    """A plain dict may take the fast path; a read-only mapping of it always takes the full one."""
    for known_version, known_kind in zip(KNOWN_VERSIONS, KNOWN_KINDS, strict=True):
        validate_envelope(
            {**valid_headers(), "x-lily-schema-version": known_version, "x-lily-content-kind": known_kind}, 0
        )
    table: dict[str, object] = {
        "x-lily-event-id": str(event_id),
        "x-lily-schema-version": version,
        "x-lily-content-kind": kind,
    }
    # Near the entry bound (64 less 5 reserved) and, with four bulky values, the byte bound (32 KiB less 2 KiB).
    table.update({f"pad-{i}": "p" for i in range(entries)})
    table.update({f"bulk-{i}": "b" * bulk for i in range(4 if bulk else 0)})
    table.update(extra)
    table.update(overrides)
    table.update(boundary)
    full = check_total(types.MappingProxyType(table), 0)
    fast = check_total(table, 0)
    if isinstance(full, Envelope):
        assert fast == full
        assert isinstance(fast, Envelope)
        assert type(fast.event_id) is uuid.UUID
        assert str(fast.event_id) == str(full.event_id)
    else:
        assert isinstance(fast, EnvelopeError)
        assert (fast.code, fast.reason) == (full.code, full.reason)


def test_fast_path_is_taken_for_a_typical_delivery() -> None:
    """The agreement above is not vacuous: a typical delivery is accepted without the full checks."""
    table = {**valid_headers(), "x-retry-count": 3, "traceparent": TRACEPARENT, "tracestate": "rojo=1"}
    full = validate_envelope(types.MappingProxyType(table), 0)
    assert envelope_module._accept_common(table) == full
    assert envelope_module._accept_common({**table, "x-retry-count": True}) is None
    assert envelope_module._accept_common({**table, "x-lily-schema-version": "70000"}) is None


@FAST
@given(event_id=canonical_uuids)
def test_fast_uuid_construction_equals_uuid_parsing(event_id: uuid.UUID) -> None:
    parsed = canonical_uuid(str(event_id))
    assert parsed == event_id
    assert hash(parsed) == hash(event_id)
    assert str(parsed) == str(event_id)
    assert parsed.version == event_id.version
    assert parsed.is_safe is uuid.SafeUUID.unknown
