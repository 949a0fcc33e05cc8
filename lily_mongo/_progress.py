"""A running service's progress: one INFO line per interval while it works, with its counts and rate
(docs/observability.md, section 3)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Final

from ._snapshots import Snapshot

__all__ = ["PROGRESS_INTERVAL", "Progress", "outcome_totals"]

log = logging.getLogger("lily_mongo")

PROGRESS_INTERVAL: Final = 10.0  # seconds between two progress lines of a busy service


def outcome_totals(snapshot: Snapshot) -> dict[str, int]:
    """A consumer's deliveries by terminal outcome since its start, summed over its queues."""
    totals: dict[str, int] = {}
    for queue in snapshot.queues:
        for outcome, count in queue.outcomes.items():
            totals[outcome] = totals.get(outcome, 0) + count
    return totals


class Progress:
    """Counts read from ``read`` (by outcome, or a relay's ``published``), said once per interval when
    they moved: ``progress: 412 deliveries in 10.0 s (41.2/s): acked=400, duplicate=12; 880 since start``.
    An idle interval says nothing; the last line, when the task is cancelled at shutdown, covers the
    interval's part that ran."""

    def __init__(
        self, read: Callable[[], Mapping[str, int]], what: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._read = read
        self._what = what
        self._clock = clock
        self.started = clock()
        self._last: dict[str, int] = {}
        self._last_at = self.started

    def elapsed(self) -> float:
        return self._clock() - self.started

    def line(self) -> str | None:
        """The line for the interval since the last one, or None when nothing moved."""
        now = self._clock()
        totals = dict(self._read())
        moved = {k: v - self._last.get(k, 0) for k, v in totals.items() if v != self._last.get(k, 0)}
        count = sum(moved.values())
        if count <= 0:
            return None
        span = max(now - self._last_at, 1e-6)
        self._last, self._last_at = totals, now
        counts = ", ".join(f"{k}={v}" for k, v in sorted(moved.items()))
        return (
            f"progress: {count} {self._what} in {span:.1f} s ({count / span:.1f}/s): {counts}; "
            f"{sum(totals.values())} since start"
        )

    def say(self) -> None:
        line = self.line()
        if line is not None:
            log.info("%s", line, extra={"progress": self._last})

    async def run(self, interval: float = PROGRESS_INTERVAL) -> None:
        """Say the progress every ``interval`` seconds until cancelled; then once more."""
        try:
            while True:
                await asyncio.sleep(interval)
                self.say()
        finally:
            self.say()
