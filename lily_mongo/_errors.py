"""The exception tree and the stable error codes.

One root (:class:`LilyError`) with subtrees by what the caller can do about it
(docs/design.md, errors). Error codes are plain strings on the wire
(``x-lily-failure-code``); :class:`ErrorCode` names the ones the framework
itself produces.
"""

from __future__ import annotations

import enum
from typing import Literal

__all__ = [
    "CommitOutcomeUnknown",
    "ConfigError",
    "EnvelopeError",
    "ErrorCode",
    "LilyError",
    "PlanError",
    "PublishError",
    "QueueHandlerError",
    "ScopeClosedError",
    "TransportError",
]


class ErrorCode(enum.StrEnum):
    """Stable failure codes produced by the framework (docs/settlement.md lists them)."""

    ENVELOPE_INVALID = "QUEUE_ENVELOPE_INVALID"
    METADATA_BOUNDS_EXCEEDED = "QUEUE_METADATA_BOUNDS_EXCEEDED"
    BODY_TOO_LARGE = "QUEUE_BODY_TOO_LARGE"
    SCHEMA_VERSION_UNSUPPORTED = "QUEUE_SCHEMA_VERSION_UNSUPPORTED"
    CONTENT_KIND_UNSUPPORTED = "QUEUE_CONTENT_KIND_UNSUPPORTED"
    PAYLOAD_DECODE_FAILED = "QUEUE_PAYLOAD_DECODE_FAILED"
    # A body that decoded but that the payload's model refused (a pydantic validation error): the
    # producer sent the wrong shape, not bytes nobody can read (docs/settlement.md).
    PAYLOAD_INVALID = "QUEUE_PAYLOAD_INVALID"
    RETRIES_EXHAUSTED = "QUEUE_RETRIES_EXHAUSTED"
    DEFERRALS_EXHAUSTED = "QUEUE_DEFERRALS_EXHAUSTED"
    HANDLER_FAILED = "QUEUE_HANDLER_FAILED"
    HANDLER_TIMEOUT = "QUEUE_HANDLER_TIMEOUT"
    GUARD_REJECTED = "QUEUE_GUARD_REJECTED"
    # An event whose attempt outlived the server's transaction lifetime twice (docs/inbox.md,
    # "The transaction lifetime"): dead-lettered rather than replayed again.
    TRANSACTION_EXPIRED = "QUEUE_TRANSACTION_EXPIRED"
    # Deferral codes: why a delivery was requeued without spending an application retry
    # (docs/settlement.md section 4, "deferred"). Kept unprefixed: they never reach a DLQ copy as such
    # (an exhausted deferral bound dead-letters with QUEUE_DEFERRALS_EXHAUSTED).
    LEASE_HELD = "LEASE_HELD"
    LEASE_LOST = "LEASE_LOST"
    LEASE_BUSY = "LEASE_BUSY"
    REPLAY_BUDGET_SPENT = "REPLAY_BUDGET_SPENT"
    COMMIT_AMBIGUOUS = "COMMIT_AMBIGUOUS"
    MONGO_UNAVAILABLE = "MONGO_UNAVAILABLE"
    MONGO_ERROR = "MONGO_ERROR"
    SHUTDOWN = "SHUTDOWN"


class LilyError(Exception):
    """Root of every exception raised by lily_mongo."""


class ConfigError(LilyError, ValueError):
    """An option or registration is invalid; fix the configuration."""


class PlanError(ConfigError):
    """The registered consumer plan breaks a bound or a rule (docs/configuration.md)."""


class EnvelopeError(LilyError):
    """A delivery's envelope or metadata is invalid; the delivery is rejected permanently.

    ``code`` is a stable :class:`ErrorCode` value; ``reason`` is bounded and sanitized:
    it names the header and the bound and never echoes an unbounded raw value.
    """

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


class QueueHandlerError(LilyError):
    """Raised by a handler to choose its settlement: retry later, or dead-letter now."""

    def __init__(self, code: str, message: str = "", *, kind: Literal["retryable", "permanent"]) -> None:
        if not isinstance(code, str) or not code:
            raise ConfigError(f"QueueHandlerError code must be a non-empty string, got {code!r:.40}")
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message
        self.kind: Literal["retryable", "permanent"] = kind

    @property
    def is_retryable(self) -> bool:
        """True when the framework should hand the delivery to a retry bucket."""
        return self.kind == "retryable"

    @classmethod
    def retryable(cls, code: str, message: str = "") -> QueueHandlerError:
        """A failure that may succeed later: retried through the retry buckets."""
        return cls(code, message, kind="retryable")

    @classmethod
    def permanent(cls, code: str, message: str = "") -> QueueHandlerError:
        """A failure that will never succeed: dead-lettered at once."""
        return cls(code, message, kind="permanent")


class TransportError(LilyError):
    """The broker or database connection failed or refused an operation.

    ``unreachable`` is true when nothing answered at the address (refused, unknown
    host, timed out), as opposed to a server that answered and refused (a login,
    a virtual host) or an operation that failed. ``service`` names the party when
    the error says which (``"MongoDB"`` for every MongoDB error), else None.
    """

    def __init__(self, message: str, *, unreachable: bool = False, service: str | None = None) -> None:
        super().__init__(message)
        self.unreachable = unreachable
        self.service = service


class PublishError(TransportError):
    """A publish was not confirmed: unroutable (returned), nacked, timed out, its channel closed,
    or (``invalid``) the message could not be encoded as AMQP."""

    def __init__(self, kind: Literal["unroutable", "nacked", "timeout", "closed", "invalid"], detail: str) -> None:
        super().__init__(f"publish {kind}: {detail}")
        self.kind = kind
        self.detail = detail


class ScopeClosedError(LilyError, RuntimeError):
    """A handler scope (``MongoScope``, its outbox) was used after its attempt ended."""


class CommitOutcomeUnknown(TransportError):
    """A transaction's commit result stayed unknown after its retries and nothing read back proves it
    committed: it may or may not have. Check the data before running it again (docs/outbox.md)."""
