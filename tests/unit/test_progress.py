"""A running service's progress line: one per interval while busy, counts by outcome and the rate."""

from __future__ import annotations

import asyncio
import logging

import pytest

from lily_mongo._progress import Progress, outcome_totals
from lily_mongo._snapshots import QueueSnapshot, Snapshot


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_busy_interval_says_its_counts_by_outcome_and_rate_and_an_idle_one_says_nothing() -> None:
    clock = Clock()
    counts: dict[str, int] = {}
    progress = Progress(lambda: counts, "deliveries", clock=clock)
    assert progress.line() is None  # nothing yet
    clock.now += 10.0
    counts.update(acked=400, duplicate=12)
    assert progress.line() == "progress: 412 deliveries in 10.0 s (41.2/s): acked=400, duplicate=12; 412 since start"
    clock.now += 10.0
    assert progress.line() is None  # idle: no line
    clock.now += 5.0
    counts.update(acked=450, dead_lettered=1)
    assert progress.line() == "progress: 51 deliveries in 15.0 s (3.4/s): acked=50, dead_lettered=1; 463 since start"
    assert progress.elapsed() == 25.0


def test_the_totals_sum_every_queues_outcomes() -> None:
    def queue(index: int, outcomes: dict[str, int]) -> QueueSnapshot:
        return QueueSnapshot(index, 1, 0, 0, outcomes, sum(outcomes.values()), 0, 0, 0, 0, 0)

    snapshot = Snapshot("running", 1, (queue(0, {"acked": 3}), queue(1, {"acked": 2, "retried": 1})), None, None, 0)
    assert outcome_totals(snapshot) == {"acked": 5, "retried": 1}


async def test_the_task_says_its_line_at_info_each_interval_and_once_more_when_cancelled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counts = {"acked": 0}
    progress = Progress(lambda: counts, "deliveries")
    with caplog.at_level(logging.INFO, logger="lily_mongo"):
        task = asyncio.ensure_future(progress.run(interval=0.05))
        counts["acked"] = 3
        for _ in range(200):
            if caplog.records:
                break
            await asyncio.sleep(0.01)
        counts["acked"] = 5
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    lines = [r.getMessage() for r in caplog.records if r.name == "lily_mongo"]
    assert all(r.levelno == logging.INFO for r in caplog.records)
    assert getattr(caplog.records[-1], "progress", None) == {"acked": 5}  # the totals, for JSON logs
    assert lines[0].startswith("progress: 3 deliveries in "), lines
    assert lines[-1].startswith("progress: 2 deliveries in "), lines
    assert lines[-1].endswith("acked=2; 5 since start"), lines
