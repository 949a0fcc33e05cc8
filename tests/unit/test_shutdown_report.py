"""ShutdownReport's wording and its ``graceful`` verdict agree: a forced shutdown never reads as succeeded."""

from __future__ import annotations

import pytest

from lily_mongo import ShutdownReport
from lily_mongo._supervision import ShutdownAction


@pytest.mark.parametrize(
    ("forced", "succeeded", "unresolved", "first_line", "graceful"),
    [
        (False, True, 0, "shutdown succeeded; unresolved deliveries: 0", True),
        (True, True, 0, "shutdown FORCED; unresolved deliveries: 0", False),
        (True, False, 1, "shutdown FAILED (forced); unresolved deliveries: 1", False),
        (False, False, 0, "shutdown FAILED; unresolved deliveries: 0", False),
    ],
)
def test_the_first_line_says_how_it_ended(
    forced: bool, succeeded: bool, unresolved: int, first_line: str, graceful: bool
) -> None:
    report = ShutdownReport(
        actions=(ShutdownAction("drain", True, not forced),),
        settled={},
        unresolved=unresolved,
        forced=forced,
        succeeded=succeeded,
    )
    assert report.render().splitlines()[0] == first_line
    assert report.graceful is graceful
    assert "succeeded" not in report.render() or graceful


def test_the_report_ends_with_the_runs_totals() -> None:
    report = ShutdownReport(
        actions=(ShutdownAction("drain", True, True, None, 0.002),),
        settled={"acked": 2},
        unresolved=0,
        forced=False,
        succeeded=True,
        totals={"acked": 880, "duplicate": 120, "dead_lettered": 5, "retried": 0},
        elapsed=42.04,
    )
    assert report.render().splitlines()[-1] == "run totals: acked=880, dead_lettered=5, duplicate=120 in 42.0 s"


def test_an_idle_run_says_it_handled_nothing() -> None:
    report = ShutdownReport(actions=(), settled={}, unresolved=0, forced=False, succeeded=True)
    assert report.render().splitlines()[-1] == "run totals: none in 0.0 s"
