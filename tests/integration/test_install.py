"""Install as the README says: the built wheel, with its extras, in a fresh virtual environment.

``uv build`` makes the wheel; a new venv (no access to the checkout: the commands run in a
temporary directory, with no ``PYTHONPATH``) installs it with ``[cli,embedded,http]``; then its
own ``lily-mongo`` answers ``--version`` and runs the README's service on its own embedded
server. Slow (a build and an install: about half a minute with uv's cache warm), so it has a
module-wide timeout of its own; it needs uv on the PATH and skips without it.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from tests.integration.test_cli_embedded import readme_service
from tests.support.broker import Broker
from tests.support.cli import wait_for_consumers
from tests.support.polling import eventually
from tests.support.probes import free_port
from tests.support.processes import started

ROOT = Path(__file__).resolve().parents[2]
UV = shutil.which("uv")

pytestmark = [
    pytest.mark.skipif(UV is None, reason="needs uv on the PATH"),
    pytest.mark.skipif(sys.version_info < (3, 13), reason="the embedded extra needs Python 3.13+"),
    pytest.mark.timeout(600),
]


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without anything that would find the checkout or this test run's venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT")}
    env.update(NO_COLOR="1", COLUMNS="200", PYTHONUNBUFFERED="1", **extra)
    return env


def sh(*argv: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    done = subprocess.run(argv, cwd=cwd, env=env or clean_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin directory of a fresh venv holding the built wheel with [cli,embedded,http]."""
    assert UV is not None
    work = tmp_path_factory.mktemp("install")
    sh(UV, "build", "--wheel", "--out-dir", str(work / "dist"), str(ROOT), cwd=work)
    (wheel,) = (work / "dist").glob("lily_mongo-*.whl")
    sh(UV, "venv", "--python", sys.executable, str(work / "venv"), cwd=work)
    python = work / "venv" / "bin" / "python"
    sh(UV, "pip", "install", "--python", str(python), f"lily-mongo[cli,embedded,http] @ {wheel.as_uri()}", cwd=work)
    return python.parent


def test_the_wheel_installs_with_its_extras_and_answers_version(installed: Path, tmp_path: Path) -> None:
    out = sh(str(installed / "lily-mongo"), "--version", cwd=tmp_path)
    assert out == f"lily-mongo {importlib.metadata.version('lily-mongo')}\n"
    where = sh(str(installed / "python"), "-c", "import lily_mongo; print(lily_mongo.__file__)", cwd=tmp_path)
    assert Path(where.strip()).is_relative_to(installed.parent), where  # the venv's copy, not the checkout
    sh(str(installed / "python"), "-c", "import aiohttp, mongoeco, typer, prometheus_client", cwd=tmp_path)


async def test_the_readme_service_runs_from_the_installed_wheel(
    broker: Broker, installed: Path, tmp_path: Path
) -> None:
    port = free_port()
    q = broker.queue("orders.created")
    source = readme_service().replace("127.0.0.1:27017", f"127.0.0.1:{port}").replace('"orders.created"', repr(q))
    (tmp_path / "myservice.py").write_text(source)
    uri = f"mongodb://127.0.0.1:{port}/"
    env = clean_env(LILY_AMQP_URL=broker.url, LILY_MONGO_URI=uri)
    lily = str(installed / "lily-mongo")
    async with started([lily, "embedded", "--port", str(port)], env=env, cwd=tmp_path) as server:
        assert (await server.read_line(timeout=60)).strip() == uri
        client: AsyncMongoClient[Any] = AsyncMongoClient(uri, serverSelectionTimeoutMS=10_000)
        try:
            async with started([lily, "run", "myservice:consumer"], env=env, cwd=tmp_path) as service:
                await wait_for_consumers(broker.connection, q, service)
                await broker.publish(q, {"order_id": "A1", "total_cents": 500})

                async def recorded() -> bool:
                    return await client.shop.orders.find_one({"_id": "A1"}) is not None

                await eventually(recorded, timeout=30, what="order A1 in shop.orders", interval=0.1)
                result = await service.stop(timeout=30)
            assert result.returncode == 0, result.describe()
            assert result.stdout.startswith("shutdown succeeded"), result.describe()
            assert "run totals: acked=1 in " in result.stdout, result.describe()
        finally:
            await client.close()
        await server.stop(timeout=20)
