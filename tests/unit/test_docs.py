"""The documentation's tables list what the code defines; its Python blocks are read as documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lily_mongo import ErrorCode
from tests import docblocks

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_settlement_page_lists_every_deferral_code_once() -> None:
    text = (DOCS / "settlement.md").read_text()
    table = text.split("<!-- deferral-codes:", 1)[1].split("\n\n", 1)[0]
    listed = re.findall(r"^\| `([A-Z_]+)` \|", table, flags=re.MULTILINE)
    # Deferral codes are the ErrorCode members without the QUEUE_ prefix.
    defined = [code.value for code in ErrorCode if not code.value.startswith("QUEUE_")]
    assert sorted(listed) == sorted(defined)
    assert len(listed) == len(set(listed))


# -- the documentation's Python blocks (tests/docblocks.py; run by tests/integration/test_docs_blocks.py) ---

ROOT = DOCS.parent
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def test_blocks_are_found_with_their_page_lines_and_markers() -> None:
    text = (
        "# Page\n"  # 1
        "\n"  # 2
        "```python\n"  # 3
        "x = 1\n"  # 4
        "```\n"  # 5
        "<!-- not runnable: needs a replica set -->\n"  # 6
        "```python\n"  # 7
        "y = 2\n"  # 8
        "z = 3\n"  # 9
        "```\n"  # 10
        "```bash\n"  # 11
        "echo not python\n"  # 12
        "```\n"  # 13
        "1. a list item:\n"  # 14
        "   ```python\n"  # 15
        "   w = 4\n"  # 16
        "   ```\n"  # 17
    )
    found = docblocks.blocks(text, "page.md")
    assert [(b.line, b.code, b.not_runnable) for b in found] == [
        (4, "x = 1\n", None),
        (8, "y = 2\nz = 3\n", "needs a replica set"),
        (16, "w = 4\n", None),
    ]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("<!-- not runnable -->\n```python\nx\n```\n", "page.md:1: a not-runnable marker needs a reason"),
        ("<!-- not runnable:   -->\n```python\nx\n```\n", "page.md:1: a not-runnable marker needs a reason"),
        ("<!-- not runnable: why -->\n\n```python\nx\n```\n", "page.md:1: a not-runnable marker must be right above"),
        ("<!-- not runnable: why -->\n```bash\nx\n```\n", "page.md:1: a not-runnable marker must be right above"),
        ("text\n<!-- not runnable: why -->\n", "page.md:2: a not-runnable marker must be right above"),
        ("```python\nx = 1\n", "page.md:1: a code fence that is never closed"),
    ],
)
def test_a_misused_marker_or_an_open_fence_is_refused_with_its_line(text: str, says: str) -> None:
    with pytest.raises(docblocks.MarkerError) as info:
        docblocks.blocks(text, "page.md")
    assert str(info.value).startswith(says), str(info.value)


def test_a_marker_inside_another_fence_is_text() -> None:
    text = "```text\n<!-- not runnable -->\n```\n```python\nx = 1\n```\n"
    assert [(b.line, b.not_runnable) for b in docblocks.blocks(text, "page.md")] == [(5, None)]


def test_the_documented_servers_are_rewritten_only_as_whole_string_literals() -> None:
    code = (
        'a = "amqp://guest:guest@127.0.0.1/"\n'
        "b = 'amqp://guest:guest@127.0.0.1:5672/'\n"
        'c = "mongodb://127.0.0.1:27017/"\n'
        'd = "mongodb://127.0.0.1:27017/?replicaSet=rs0"\n'
    )
    assert docblocks.rewrite(code, "amqp://u:p@h:1/v", "mongodb://h:2/") == (
        'a = "amqp://u:p@h:1/v"\nb = \'amqp://u:p@h:1/v\'\nc = "mongodb://h:2/"\nd = "mongodb://127.0.0.1:27017/?replicaSet=rs0"\n'
    )


def test_a_page_defining_tests_is_a_test_page() -> None:
    tests = docblocks.blocks("```python\nasync def test_x():\n    pass\n```\n", "page.md")
    script = docblocks.blocks("```python\nasync def step():\n    pass\nawait step()\n```\n", "page.md")
    marked = docblocks.blocks("<!-- not runnable: a sketch -->\n```python\ndef test_y(): ...\n```\n", "page.md")
    assert (docblocks.is_test_page(tests), docblocks.is_test_page(script), docblocks.is_test_page(marked)) == (
        True,
        False,
        False,
    )


def test_a_test_pages_module_keeps_each_block_on_its_page_lines() -> None:
    text = (
        "```python\n"  # 1
        "import os\n"  # 2
        "```\n"  # 3
        "text\n"  # 4
        "<!-- not runnable: a sketch -->\n"  # 5
        "```python\n"  # 6
        "nope(\n"  # 7: not runnable, left out
        "```\n"  # 8
        "```python\n"  # 9
        "def test_a(): ...\n"  # 10
        "```\n"
    )
    source = docblocks.module_source(docblocks.blocks(text, "page.md"), "amqp://x/", "mongodb://y/")
    assert source.splitlines() == ["", "import os", *[""] * 7, "def test_a(): ..."]


async def test_a_script_page_runs_in_order_in_one_namespace_as_a_plain_script() -> None:
    text = (
        "```python\nimport asyncio\nvalues = []\n```\n"
        "```python\nasync def main():\n    await asyncio.sleep(0)\n    values.append(1)\n\nasyncio.run(main())\n```\n"
    )
    namespace = await docblocks.run_script(docblocks.blocks(text, "page.md"), "docs_probe", "amqp://x/", "mongodb://y/")
    assert namespace["values"] == [1]


@pytest.mark.parametrize(
    "code", ["await asyncio.sleep(0)", "async with lock:\n    pass", "async for x in y:\n    pass"]
)
async def test_a_block_a_plain_script_cannot_run_is_refused_with_the_way_out(code: str) -> None:
    text = f"```python\nimport asyncio\n{code}\n```\n"
    with pytest.raises(docblocks.NotAScript, match=r"page\.md:3: .*outside.*asyncio\.run\(main\(\)\)"):
        await docblocks.run_script(docblocks.blocks(text, "page.md"), "docs_probe", "amqp://x/", "mongodb://y/")


async def test_a_failing_block_names_its_page_and_line() -> None:
    text = "intro\n\n```python\nx = 1\nraise RuntimeError('documented bug')\n```\n"
    with pytest.raises(RuntimeError) as info:
        await docblocks.run_script(docblocks.blocks(text, "page.md"), "docs_probe", "amqp://x/", "mongodb://y/")
    frame = info.traceback[-1]
    assert (str(frame.path), frame.lineno + 1) == ("page.md", 5)


@pytest.mark.parametrize("page", PAGES, ids=lambda path: path.name)
def test_every_page_reads_and_every_marker_has_a_reason(page: Path) -> None:
    for block in docblocks.blocks(page.read_text(), page.name):
        if block.not_runnable is None:  # what runs must compile as a plain script (the integration test runs it)
            compile(block.code, block.page, "exec", dont_inherit=True)
