"""A physical queue's options and its retry policy, every bound checked at construction
(docs/configuration.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from .._checks import check_int, check_seconds
from .._errors import ConfigError
from .._text import describe_value
from ..bounds import BOUNDS, utf8_len

__all__ = [
    "BROKER_DEFAULT_CONSUMER_TIMEOUT",
    "QueueOptions",
    "QueueType",
    "RetryPolicy",
    "check_name",
    "consumer_timeout_warning",
    "longest_unacked",
]


QueueType = Literal["classic", "quorum"]


# Longest derived name: "<queue>.retry.<31>" (docs/settlement.md section 8, topology).
LONGEST_SUFFIX = max(len(f".retry.{BOUNDS.retry_buckets_per_queue - 1}"), len(".dlq"))


_MAX_DELAY_SECONDS = 7 * 24 * 3600.0
BROKER_DEFAULT_CONSUMER_TIMEOUT = 1800.0
"""RabbitMQ's ``consumer_timeout`` when neither the node's configuration, a policy nor an argument sets one."""


def _check_seconds(field_name: str, value: object, *, low: float = 0.0, high: float = _MAX_DELAY_SECONDS) -> float:
    """Seconds above ``low`` (exclusive) up to ``high``: every duration in a plan."""
    return check_seconds(field_name, value, low=low, high=high, low_inclusive=False)


def check_name(field_name: str, name: object, *, suffix_bytes: int = 0) -> str:
    """A queue/exchange/routing name: 1..200 UTF-8 bytes, derived names included."""
    if not isinstance(name, str):
        raise ConfigError(f"{field_name} must be a string, got {describe_value(name)}")
    size = utf8_len(name)
    limit = BOUNDS.name_max_bytes - suffix_bytes
    if not BOUNDS.name_min_bytes <= size <= limit:
        extra = f" (leaving {suffix_bytes} bytes for derived names)" if suffix_bytes else ""
        raise ConfigError(f"{field_name} {name[:40]!r} is {size} bytes, outside 1..{limit} bytes{extra}")
    return name


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """Application retries through delay buckets.

    Retry ``n`` (0-based) waits ``delays[min(n, len(delays) - 1)]`` seconds in a
    retry bucket; each distinct delay is one bucket (``<queue>.retry.<i>``).
    """

    max_retries: int = 5
    delays: tuple[float, ...] = (1.0, 5.0, 30.0, 120.0, 600.0)

    def __post_init__(self) -> None:
        check_int("RetryPolicy.max_retries", self.max_retries, 0, BOUNDS.max_retries)
        delays = tuple(self.delays) if isinstance(self.delays, Sequence) else self.delays
        if not isinstance(delays, tuple) or (self.max_retries > 0 and not delays):
            raise ConfigError(f"RetryPolicy.delays must be a non-empty sequence of seconds, got {self.delays!r:.60}")
        for i, delay in enumerate(delays):
            _check_seconds(f"RetryPolicy.delays[{i}]", delay, low=0.0)
            if round(delay * 1000) < 1:
                raise ConfigError(f"RetryPolicy.delays[{i}] must be at least 0.001 seconds, got {delay!r}")
        object.__setattr__(self, "delays", tuple(float(d) for d in delays))
        if len(self.bucket_delays_ms) > BOUNDS.retry_buckets_per_queue:
            raise ConfigError(
                f"RetryPolicy.delays has {len(self.bucket_delays_ms)} distinct delays, "
                f"over the bound of {BOUNDS.retry_buckets_per_queue} buckets per queue"
            )

    @property
    def bucket_delays_ms(self) -> tuple[int, ...]:
        """Distinct delays in milliseconds, in first-use order; bucket ``i`` has delay ``[i]``."""
        if self.max_retries == 0:
            return ()
        used = [round(self.delays[min(n, len(self.delays) - 1)] * 1000) for n in range(self.max_retries)]
        return tuple(dict.fromkeys(used))

    def bucket_for(self, retry: int) -> int:
        """Index of the bucket that holds retry ``retry`` (0-based)."""
        delay = round(self.delays[min(retry, len(self.delays) - 1)] * 1000)
        return self.bucket_delays_ms.index(delay)


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueOptions:
    """Per physical queue settings; bounds checked at construction."""

    name: str
    concurrency: int = 8
    prefetch: int = 64
    buffer: int | None = None
    max_body: int = BOUNDS.queue_body_default
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    queue_type: QueueType = "classic"
    deadline: float = 60.0
    cooperation_window: float = 5.0
    max_deferrals: int = 20
    max_handoff_failures: int = 5
    passive: bool = False
    unknown_errors: Literal["retryable", "permanent"] = "retryable"
    ack_delay: float = 0.001
    consumer_timeout: float | None = None

    def __post_init__(self) -> None:
        where = f"queue {self.name!r:.60}"
        check_name("queue name", self.name, suffix_bytes=LONGEST_SUFFIX)
        check_int(f"{where}: concurrency", self.concurrency, BOUNDS.concurrency_min, BOUNDS.concurrency_max)
        check_int(f"{where}: prefetch", self.prefetch, 1, BOUNDS.prefetch_max)
        if self.buffer is None:
            object.__setattr__(self, "buffer", self.prefetch)
        check_int(f"{where}: buffer", self.buffer, 0, self.prefetch)
        check_int(f"{where}: max_body", self.max_body, 1, BOUNDS.queue_body_max)
        if not isinstance(self.retry, RetryPolicy):
            raise ConfigError(f"{where}: retry must be a RetryPolicy, got {type(self.retry).__name__}")
        if self.queue_type not in ("classic", "quorum"):
            raise ConfigError(f"{where}: queue_type must be 'classic' or 'quorum', got {self.queue_type!r:.40}")
        _check_seconds(f"{where}: deadline", self.deadline, high=24 * 3600.0)
        _check_seconds(f"{where}: cooperation_window", self.cooperation_window, high=3600.0)
        check_int(f"{where}: max_deferrals", self.max_deferrals, 1, 10_000)
        check_int(f"{where}: max_handoff_failures", self.max_handoff_failures, 1, 1000)
        if self.unknown_errors not in ("retryable", "permanent"):
            raise ConfigError(
                f"{where}: unknown_errors must be 'retryable' or 'permanent', got {describe_value(self.unknown_errors)}"
            )
        if not isinstance(self.passive, bool):
            raise ConfigError(f"{where}: passive must be True or False, got {describe_value(self.passive)}")
        check_seconds(f"{where}: ack_delay", self.ack_delay, low=0.0, high=BOUNDS.ack_delay_max)
        if self.consumer_timeout is not None:
            _check_seconds(f"{where}: consumer_timeout", self.consumer_timeout)

    @property
    def effective_prefetch(self) -> int:
        """Unacked deliveries the broker may push: never more than running plus buffered."""
        assert self.buffer is not None
        return min(self.prefetch, self.concurrency + self.buffer)

    def bucket_name(self, index: int) -> str:
        return f"{self.name}.retry.{index}"

    @property
    def dlq_name(self) -> str:
        return f"{self.name}.dlq"


def longest_unacked(options: QueueOptions, settlement: float) -> float:
    """The longest a delivery of the queue may stay unacknowledged, in seconds (docs/deployment.md).

    It waits in the prefetch buffer while the deliveries ahead of it take every permit,
    each for up to its deadline and cooperation window; then it runs as long itself; then
    it settles, for up to ``settlement`` seconds (a handoff's confirm, the pause before a requeue).
    """
    turn = options.deadline + options.cooperation_window
    waiting = max(options.effective_prefetch - options.concurrency, 0)
    turns_before = -(-waiting // options.concurrency)
    return (turns_before + 1) * turn + settlement


def consumer_timeout_warning(options: QueueOptions, settlement: float) -> str | None:
    """What a consumer says at start when a delivery of the queue could stay unacknowledged past the
    broker's consumer timeout; None when it cannot.

    Against ``options.consumer_timeout`` (the timeout the broker applies to the queue, as the
    operator configured it) the whole wait counts, the prefetch buffer's included. When it is
    not set the timeout is not known: only a delivery's own run and settlement are held against
    RabbitMQ's default, so a long backlog behind few permits does not warn on every start.
    """
    timeout = options.consumer_timeout
    if timeout is None:
        timeout, source = BROKER_DEFAULT_CONSUMER_TIMEOUT, "RabbitMQ's default (consumer_timeout not set)"
        longest = options.deadline + options.cooperation_window + settlement
        what = f"deadline={options.deadline:g} s with cooperation_window={options.cooperation_window:g} s, settlement"
    else:
        source = "consumer_timeout"
        longest = longest_unacked(options, settlement)
        what = (
            f"the prefetch buffer's wait behind concurrency={options.concurrency}, deadline={options.deadline:g} s "
            f"with cooperation_window={options.cooperation_window:g} s, settlement"
        )
    if longest <= timeout:
        return None
    return (
        f"queue {options.name!r:.80}: a delivery may stay unacknowledged up to {longest:.0f} s ({what}), past the "
        f"broker's consumer timeout of {timeout:g} s, {source}: the broker then cancels the consumer (or closes "
        "its channel) and redelivers; lower prefetch, buffer or the deadline, or raise the timeout "
        "(docs/deployment.md)"
    )
