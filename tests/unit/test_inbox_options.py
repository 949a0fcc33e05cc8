"""InboxOptions: every field is checked when given, and the error names the field, the value and the bound."""

from __future__ import annotations

from typing import Any

import pytest

from lily_mongo import ConfigError, InboxOptions


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"lease_seconds": 0.01}, ("InboxOptions.lease_seconds", "0.01", "0.05..3600")),
        ({"lease_seconds": float("nan")}, ("InboxOptions.lease_seconds", "nan")),
        ({"lease_seconds": True}, ("InboxOptions.lease_seconds", "True")),
        ({"heartbeat_seconds": 0}, ("InboxOptions.heartbeat_seconds", "0", "> 0")),
        ({"lease_seconds": 3, "heartbeat_seconds": 3}, ("InboxOptions.heartbeat_seconds", "3", "< lease_seconds (3)")),
        ({"retention_seconds": 59}, ("InboxOptions.retention_seconds", "59", "60..31622400")),
        ({"stale_lease_seconds": 0}, ("InboxOptions.stale_lease_seconds", "0", "1..31622400")),
        ({"replay_budget": 101}, ("InboxOptions.replay_budget", "101", "0..100")),
        ({"replay_budget": -1}, ("InboxOptions.replay_budget", "-1", "0..100")),
        ({"commit_retries": 1.5}, ("InboxOptions.commit_retries", "1.5", "0..100")),
        ({"backoff_base": -1}, ("InboxOptions.backoff_base", "-1", "> 0")),
        ({"backoff_max": 0}, ("InboxOptions.backoff_max", "0", "> 0")),
        ({"backoff_base": 2.0, "backoff_max": 1.0}, ("InboxOptions.backoff_base", "2.0", "<= backoff_max (1)")),
        ({"records": ""}, ("InboxOptions.records", "1..120 bytes")),
        ({"records": "a$b"}, ("InboxOptions.records", "a$b")),
        ({"passive_indexes": "yes"}, ("InboxOptions.passive_indexes", "yes")),
        ({"claim_in_transaction": "no"}, ("InboxOptions.claim_in_transaction", "no")),
        ({"max_wait_seconds": 0.01}, ("InboxOptions.max_wait_seconds", "0.01", "0.05..600")),
        ({"max_wait_seconds": 601}, ("InboxOptions.max_wait_seconds", "601", "0.05..600")),
        ({"transaction_lifetime_seconds": 0.5}, ("InboxOptions.transaction_lifetime_seconds", "0.5", "1..86400")),
        ({"transaction_lifetime_seconds": "60"}, ("InboxOptions.transaction_lifetime_seconds", "60")),
    ],
)
def test_a_value_out_of_bounds_is_refused_naming_field_value_and_bound(
    options: dict[str, Any], named: tuple[str, ...]
) -> None:
    with pytest.raises(ConfigError) as info:
        InboxOptions(**options)
    for part in named:
        assert part in str(info.value), (part, str(info.value))


# The lowest and the highest value each field with fixed bounds takes (the bounds the refusals above name).
INBOX_BOUNDS: dict[str, tuple[float, float]] = {
    "lease_seconds": (0.05, 3600),
    "retention_seconds": (60, 31622400),
    "stale_lease_seconds": (1, 31622400),
    "replay_budget": (0, 100),
    "commit_retries": (0, 100),
    "max_wait_seconds": (0.05, 600),
    "transaction_lifetime_seconds": (1, 86400),
}
# The fields bounded by each other at their edges: a heartbeat below the shortest lease, a base equal to its max.
RELATIVE_EDGES = {"heartbeat_seconds": 0.01, "backoff_base": 1.0, "backoff_max": 1.0}


@pytest.mark.parametrize("end", [0, 1], ids=["lowest", "highest"])
def test_the_bounds_themselves_are_accepted(end: int) -> None:
    values: dict[str, Any] = {field: bounds[end] for field, bounds in INBOX_BOUNDS.items()} | RELATIVE_EDGES
    options = InboxOptions(**values)
    assert {field: getattr(options, field) for field in values} == values


def test_the_defaults() -> None:
    options = InboxOptions()
    assert (options.records, options.lease_seconds) == ("lily_inbox", 30.0)
    assert options.heartbeat_seconds == pytest.approx(10.0)  # a third of the lease
    assert (options.max_wait_seconds, options.transaction_lifetime_seconds) == (10.0, None)  # read at start
