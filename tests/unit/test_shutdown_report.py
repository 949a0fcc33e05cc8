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
