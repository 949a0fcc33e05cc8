"""The inbox's options, checked at construction (docs/configuration.md)."""

from __future__ import annotations

from dataclasses import dataclass

from .._checks import check_bool, check_int, check_seconds
from .._errors import ConfigError

__all__ = ["InboxOptions"]


@dataclass(frozen=True, slots=True, kw_only=True)
class InboxOptions:
    """The record collection, lease timing, retention and replay budgets of the inbox
    (the outbox has its own: :class:`~lily_mongo.OutboxOptions`)."""

    records: str = "lily_inbox"
    lease_seconds: float = 30.0
    heartbeat_seconds: float | None = None  # default: lease_seconds / 3
    retention_seconds: float = 7 * 24 * 3600.0
    stale_lease_seconds: float = 24 * 3600.0
    replay_budget: int = 5
    commit_retries: int = 3
    backoff_base: float = 0.02
    backoff_max: float = 1.0
    passive_indexes: bool = False
    claim_in_transaction: bool = True
    max_wait_seconds: float = 10.0
    transaction_lifetime_seconds: float | None = None  # default: read from the server at start

    def __post_init__(self) -> None:
        value = self.records
        if not isinstance(value, str) or not 0 < len(value.encode()) <= 120 or "$" in value:
            raise ConfigError(f"InboxOptions.records must be a collection name of 1..120 bytes, got {value!r:.60}")
        lease_seconds = check_seconds("InboxOptions.lease_seconds", self.lease_seconds, low=0.05, high=3600)
        heartbeat = self.heartbeat_seconds if self.heartbeat_seconds is not None else lease_seconds / 3
        check_seconds("InboxOptions.heartbeat_seconds", heartbeat, low=0, high=lease_seconds, low_inclusive=False)
        if heartbeat >= self.lease_seconds:
            raise ConfigError(
                f"InboxOptions.heartbeat_seconds must be < lease_seconds ({self.lease_seconds:g}), got {heartbeat!r}"
            )
        object.__setattr__(self, "heartbeat_seconds", float(heartbeat))
        check_seconds("InboxOptions.retention_seconds", self.retention_seconds, low=60, high=366 * 24 * 3600)
        check_seconds("InboxOptions.stale_lease_seconds", self.stale_lease_seconds, low=1, high=366 * 24 * 3600)
        check_int("InboxOptions.replay_budget", self.replay_budget, 0, 100)
        check_int("InboxOptions.commit_retries", self.commit_retries, 0, 100)
        check_seconds("InboxOptions.backoff_base", self.backoff_base, low=0, high=60, low_inclusive=False)
        check_seconds("InboxOptions.backoff_max", self.backoff_max, low=0, high=600, low_inclusive=False)
        if self.backoff_base > self.backoff_max:
            raise ConfigError(
                f"InboxOptions.backoff_base must be <= backoff_max ({self.backoff_max:g}), got {self.backoff_base!r}"
            )
        check_bool("InboxOptions.passive_indexes", self.passive_indexes)
        check_bool("InboxOptions.claim_in_transaction", self.claim_in_transaction)
        check_seconds("InboxOptions.max_wait_seconds", self.max_wait_seconds, low=0.05, high=600)
        if self.transaction_lifetime_seconds is not None:
            check_seconds(
                "InboxOptions.transaction_lifetime_seconds", self.transaction_lifetime_seconds, low=1, high=86400
            )
