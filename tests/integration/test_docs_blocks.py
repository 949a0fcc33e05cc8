"""Every ```python block of README.md and docs/*.md runs as written (tests/docblocks.py says how).

Blocks marked ``<!-- not runnable: <reason> -->`` are left out. The documented servers
are rewritten to the test's: the local RabbitMQ, in a virtual host of its own when
``rabbitmqctl`` can make one (so the pages' queue names, such as ``orders.created``,
meet nobody else's), and the test session's MongoDB. Databases a page creates are
dropped afterwards.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import AsyncMongoClient
from yarl import URL

from tests import docblocks

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
WITH_BLOCKS = [page for page in PAGES if docblocks.blocks(page.read_text(), page.name)]


def _rabbitmqctl(*args: str) -> bool:
    try:
        done = subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.fixture(scope="module")
def docs_amqp(amqp: str) -> Iterator[str]:
    """The broker URL the pages run against: a fresh virtual host when rabbitmqctl can make one."""
    url = URL(amqp)
    local = url.host in ("127.0.0.1", "localhost") and shutil.which("rabbitmqctl") is not None
    vhost = f"lily_docs_{uuid.uuid4().hex[:10]}"
    if local and _rabbitmqctl("add_vhost", vhost):
        user = url.user or "guest"
        if _rabbitmqctl("set_permissions", "-p", vhost, user, ".*", ".*", ".*"):
            try:
                yield str(url.with_path("/" + vhost))
            finally:
                _rabbitmqctl("delete_vhost", vhost)
            return
        _rabbitmqctl("delete_vhost", vhost)
    yield amqp


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_every_page_with_python_blocks_is_run() -> None:
    # README.md and the handler reference have blocks that run: the list below is not empty by accident.
    assert {"README.md", "handlers.md", "testing.md"} <= {page.name for page in WITH_BLOCKS}


@pytest.mark.parametrize("page", WITH_BLOCKS, ids=page_id)
async def test_the_pages_python_blocks_run_as_written(
    page: Path,
    docs_amqp: str,
    mongo_uri: str,
    mongo_client: AsyncMongoClient[Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    page_blocks = docblocks.blocks(page.read_text(), page_id(page))  # noqa: ASYNC240  # a small local file
    runnable = [block for block in page_blocks if block.not_runnable is None]
    if not runnable:
        return  # every block is marked, with a reason (tests/unit/test_docs.py reads the markers)
    before = set(await mongo_client.list_database_names())
    monkeypatch.chdir(ROOT)  # relative paths in the pages are the repository's
    try:
        if docblocks.is_test_page(page_blocks):
            run_as_pytest(page, page_blocks, docs_amqp, mongo_uri, tmp_path)
        else:
            namespace = await docblocks.run_script(page_blocks, f"docs_{page.stem}", docs_amqp, mongo_uri)
            # A page written as a service leaves its module's client open, as a service does until
            # its process ends; this process goes on, so the test closes it.
            for value in list(namespace.values()):
                if isinstance(value, AsyncMongoClient):
                    with contextlib.suppress(Exception):  # one made in a script block's own event loop
                        await value.close()
    finally:
        for name in set(await mongo_client.list_database_names()) - before:
            await mongo_client.drop_database(name)


def run_as_pytest(page: Path, page_blocks: list[docblocks.Block], amqp_url: str, mongo_uri: str, tmp: Path) -> None:
    """A test page: its runnable blocks as one module, run by pytest in a subprocess; every test must pass."""
    module = tmp / f"test_docs_{page.stem}.py"
    module.write_text(docblocks.module_source(page_blocks, amqp_url, mongo_uri))
    (tmp / "pytest.ini").write_text("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n")
    env = {**os.environ, "LILY_MONGO_URI": mongo_uri, "LILY_AMQP_URL": amqp_url}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(module)],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    tests = docblocks.tests_defined(page_blocks)
    assert done.returncode == 0, f"{page.name} as a pytest module failed:\n{done.stdout}\n{done.stderr}"
    assert f"{len(tests)} passed" in done.stdout, done.stdout
