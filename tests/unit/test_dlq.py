"""Telling DLQ messages apart by the evidence on them, and reading replay selections (no broker)."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from lily_mongo import ConfigError
from lily_mongo.dlq import inspect_dead_letter, parse_event_ids

Q = "orders.created"
EVENT_ID = "0f8fad5b-d9cb-469f-a165-70867728950e"


def death(queue: str, reason: str) -> dict[str, Any]:
    when = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)
    return {"count": 1, "reason": reason, "queue": queue, "time": when, "exchange": "", "routing-keys": [queue]}


def library_copy(**extra: Any) -> dict[str, Any]:
    return {
        "x-lily-event-id": EVENT_ID,
        "x-retry-count": 2,
        "x-lily-failure-code": "ITEM_REJECTED",
        "x-lily-failure-reason": "the switch is off",
        "x-lily-failed-queue": Q,
        "x-lily-failed-at": "2025-01-01T12:00:00.123+00:00",
        **extra,
    }


def test_a_library_copy_shows_its_code_reason_and_time() -> None:
    seen = inspect_dead_letter(library_copy(), 10, Q)
    assert (seen.origin, seen.code, seen.reason, seen.untrusted_code) == (
        "library",
        "ITEM_REJECTED",
        "the switch is off",
        None,
    )
    assert (seen.event_id, seen.retry_count, seen.failed_at, seen.bytes) == (
        EVENT_ID,
        2,
        "2025-01-01T12:00:00.123+00:00",
        10,
    )


def test_a_library_copy_that_went_through_retry_buckets_is_still_a_library_copy() -> None:
    seen = inspect_dead_letter(library_copy(**{"x-death": [death(f"{Q}.retry.0", "expired")]}), 10, Q)
    assert seen.origin == "library"


def test_a_broker_dead_letter_with_a_forged_code_shows_the_code_as_untrusted() -> None:
    headers = library_copy(**{"x-death": [death(Q, "rejected")]})  # the producer set every failure header
    seen = inspect_dead_letter(headers, 2_000_000, Q)
    assert (seen.origin, seen.broker_reason, seen.code, seen.untrusted_code) == (
        "broker",
        "rejected",
        None,
        "ITEM_REJECTED",
    )
    assert seen.reason == ""
    assert seen.failed_at is None
    assert seen.display_code() == "broker-native (rejected); x-lily-failure-code ITEM_REJECTED (untrusted)"


def test_the_latest_death_decides_when_a_retried_message_was_then_rejected() -> None:
    deaths = [death(Q, "rejected"), death(f"{Q}.retry.0", "expired")]  # most recent first
    assert inspect_dead_letter(library_copy(**{"x-death": deaths}), 1, Q).origin == "broker"


def test_a_failure_code_for_another_queue_is_of_unknown_origin() -> None:
    seen = inspect_dead_letter(library_copy(**{"x-lily-failed-queue": "elsewhere"}), 1, Q)
    assert (seen.origin, seen.code, seen.untrusted_code) == ("unknown", None, "ITEM_REJECTED")


def test_a_message_without_any_evidence_is_of_unknown_origin() -> None:
    seen = inspect_dead_letter({"x-lily-event-id": 42}, 3, Q)
    assert (seen.origin, seen.code, seen.untrusted_code, seen.retry_count) == ("unknown", None, None, None)
    assert seen.event_id == "int 42"


def test_unprintable_header_text_is_shown_sanitized() -> None:
    seen = inspect_dead_letter(library_copy(**{"x-lily-failure-reason": "line one\nline two\x1b[2J"}), 1, Q)
    assert seen.reason == "line one?line two?[2J"


@pytest.mark.parametrize(
    "given",
    [EVENT_ID, EVENT_ID.upper(), "{" + EVENT_ID + "}", "urn:uuid:" + EVENT_ID, EVENT_ID.replace("-", "")],
)
def test_an_event_id_may_be_given_in_any_uuid_spelling(given: str) -> None:
    assert parse_event_ids([given]) == {EVENT_ID}


@pytest.mark.parametrize("given", ["order-7", "", "00000000-0000-0000-0000-000000000000", EVENT_ID[:-1]])
def test_a_malformed_event_id_is_refused_by_name(given: str) -> None:
    with pytest.raises(ConfigError, match="is not a UUID"):
        parse_event_ids([given])
