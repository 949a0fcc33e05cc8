"""A delivery's verdict: what its pipeline concluded (docs/settlement.md), and what executing it produced.

Shared by everything that runs a handler (the engine, the inbox) and everything that reports on it
(the observer, telemetry); the settlement table decides from it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["SUCCESS", "Execution", "Outcome", "PipelineResult"]


class Outcome(enum.Enum):
    """What the pipeline concluded about the delivery."""

    SUCCESS = "success"  # handler ran; required transaction committed
    DUPLICATE = "duplicate"  # inbox already holds a completion for (handler, event)
    RETRYABLE = "retryable"  # application failure that may succeed later
    PERMANENT = "permanent"  # application or contract failure that never will
    DEFERRED = "deferred"  # lease held elsewhere / lost, replay budget spent, ambiguous commit
    BODY_TOO_LARGE = "body_too_large"  # broker-native dead-letter, body never copied


@dataclass(frozen=True, slots=True)
class PipelineResult:
    """The pipeline's verdict, with a stable code and a bounded reason for failures.

    ``exception`` is what the handler (or its middleware, guards or dependencies) raised,
    kept for the failure log and for tests (docs/handlers.md, section 5); no settlement
    decision reads it, and it takes no part in comparisons.
    """

    outcome: Outcome
    code: str | None = None
    reason: str = ""
    exception: BaseException | None = field(default=None, compare=False, repr=False)


@dataclass(slots=True)
class Execution:
    """What executing a delivery produced: its verdict and the counters behind it."""

    result: PipelineResult
    deferrals: int = 0  # lease deferrals of this event so far (from the inbox record)
    attempts: int = 0
    transient_replays: int = 0
    reconciliations: int = 0
    backoff_limit: float | None = None  # e.g. the lease's remaining time


SUCCESS = PipelineResult(Outcome.SUCCESS)
