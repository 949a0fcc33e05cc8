"""The outbox's options, checked at construction (docs/configuration.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._checks import check_bool, check_int, check_seconds
from .._errors import ConfigError
from .._text import describe_value
from ..bounds import BOUNDS, utf8_len

if TYPE_CHECKING:
    pass

# -- options --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class OutboxOptions:
    """The outbox collection, its records' bound, how they are dispatched, relayed, retried and kept.

    Used by :class:`~lily_mongo.Consumer` (``outbox=``), :class:`Outbox` and
    :class:`~lily_mongo.Relay`; every bound is checked here (docs/configuration.md).
    """

    collection: str = "lily_outbox"
    max_body: int = BOUNDS.outbox_body_default
    batch_size: int = 100
    poll_interval: float = 1.0
    claim_seconds: float = 30.0
    mark_interval: float = 1.0
    max_attempts: int = 10
    backoff_base: float = 0.5
    backoff_max: float = 60.0
    published_retention: float = 7 * 24 * 3600.0
    count_interval: float = 5.0
    run_relay: bool = True
    passive_indexes: bool = False
    transaction_retries: int = 5
    commit_retries: int = 3

    def __post_init__(self) -> None:
        name = self.collection
        if not isinstance(name, str) or not 0 < utf8_len(name) <= 120 or "$" in name or "\x00" in name:
            raise ConfigError(
                f"OutboxOptions.collection must be a collection name of 1..120 bytes without $, "
                f"got {describe_value(name)}"
            )
        check_int("OutboxOptions.max_body", self.max_body, 1, BOUNDS.outbox_body_max)
        check_int("OutboxOptions.batch_size", self.batch_size, 1, 1000)
        # A poll period near zero is a busy loop against the database; a backoff cap below
        # its base would shorten every delay to the cap.
        seconds = {
            "poll_interval": check_seconds("OutboxOptions.poll_interval", self.poll_interval, low=0.01, high=3600),
            "claim_seconds": check_seconds("OutboxOptions.claim_seconds", self.claim_seconds, low=0.1, high=86400),
            "mark_interval": check_seconds("OutboxOptions.mark_interval", self.mark_interval, low=0, high=60),
            "backoff_base": check_seconds("OutboxOptions.backoff_base", self.backoff_base, low=0.001, high=3600),
            "published_retention": check_seconds(
                "OutboxOptions.published_retention", self.published_retention, low=60, high=366 * 86400
            ),
            "count_interval": check_seconds("OutboxOptions.count_interval", self.count_interval, low=0.01, high=3600),
        }
        # A dispatched record's mark must land well before its claim expires, or a relay
        # publishes it again although its writer did.
        if seconds["mark_interval"] * 2 > seconds["claim_seconds"]:
            raise ConfigError(
                f"OutboxOptions.mark_interval must be at most half of claim_seconds ({self.claim_seconds!r}), "
                f"got {self.mark_interval!r}"
            )
        check_int("OutboxOptions.max_attempts", self.max_attempts, 1, 1000)
        seconds["backoff_max"] = check_seconds("OutboxOptions.backoff_max", self.backoff_max, low=0.001, high=86400)
        if seconds["backoff_max"] < seconds["backoff_base"]:
            raise ConfigError(
                f"OutboxOptions.backoff_max must be >= backoff_base ({self.backoff_base!r}), got {self.backoff_max!r}"
            )
        check_bool("OutboxOptions.run_relay", self.run_relay)
        check_bool("OutboxOptions.passive_indexes", self.passive_indexes)
        check_int("OutboxOptions.transaction_retries", self.transaction_retries, 0, 100)
        check_int("OutboxOptions.commit_retries", self.commit_retries, 0, 100)
        for field_name, value in seconds.items():
            object.__setattr__(self, field_name, value)


def standalone_options(options: OutboxOptions | None, name: str) -> OutboxOptions:
    """The options of a standalone :class:`Outbox` or :class:`~lily_mongo.Relay` (the defaults when None),
    checked, then its ``name``."""
    if options is None:
        options = OutboxOptions()
    if not isinstance(options, OutboxOptions):
        raise ConfigError(f"options must be an OutboxOptions, got {describe_value(options)}")
    if not isinstance(name, str) or not 0 < utf8_len(name) <= 200:
        raise ConfigError(f"name must be a string of 1..200 bytes, got {describe_value(name)}")
    return options


# Outbox.transaction's waits between re-runs and commit retries (the inbox's defaults, docs/outbox.md).
TRANSACTION_BACKOFF_BASE = 0.02
TRANSACTION_BACKOFF_MAX = 1.0
