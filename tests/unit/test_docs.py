"""The documentation's tables list what the code defines."""

from __future__ import annotations

import re
from pathlib import Path

from lily_mongo import ErrorCode

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_settlement_page_lists_every_deferral_code_once() -> None:
    text = (DOCS / "settlement.md").read_text()
    table = text.split("<!-- deferral-codes:", 1)[1].split("\n\n", 1)[0]
    listed = re.findall(r"^\| `([A-Z_]+)` \|", table, flags=re.MULTILINE)
    # Deferral codes are the ErrorCode members without the QUEUE_ prefix.
    defined = [code.value for code in ErrorCode if not code.value.startswith("QUEUE_")]
    assert sorted(listed) == sorted(defined)
    assert len(listed) == len(set(listed))
