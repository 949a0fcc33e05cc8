"""What ``import lily_mongo`` and ``lily-mongo --version`` load: not the heavy optional parts.

Each check runs in a fresh interpreter (this process has imported everything long ago). The
times themselves are measured by ``benchmarks/bench_startup.py``, not here.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest

# The optional parts: OpenTelemetry, the HTTP server (aiohttp, prometheus_client), the command's
# libraries (typer, rich, PyYAML, watchfiles), the embedded server (mongoeco), and the package's
# modules that use them (the commands, the demo's pydantic models, telemetry, the embedded server).
OPTIONAL = ("opentelemetry", "aiohttp", "prometheus_client", "typer", "rich", "yaml", "watchfiles", "mongoeco")
OPTIONAL_MODULES = ("lily_mongo._cli", "lily_mongo.embedded", "lily_mongo._embedded", "lily_mongo.testing")


def loaded_after(code: str) -> set[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    return set(json.loads(out.splitlines()[-1]))


def heavy(modules: set[str]) -> list[str]:
    return sorted(
        m
        for m in modules
        if m.split(".")[0] in OPTIONAL or any(m == o or m.startswith(o + ".") for o in OPTIONAL_MODULES)
    )


def test_import_lily_mongo_loads_no_optional_part_and_not_pymongo_or_aio_pika() -> None:
    modules = loaded_after("import lily_mongo")
    assert heavy(modules) == []
    assert {"pymongo", "aio_pika", "pydantic"} & modules == set()  # loaded with the first name that needs them


@pytest.mark.parametrize(
    "code", ["from lily_mongo import Consumer, Publisher, Relay, Outbox, Json, queue", "import lily_mongo.telemetry"]
)
def test_the_consumer_and_the_publisher_load_no_optional_part(code: str) -> None:
    assert heavy(loaded_after(code)) == []


def test_every_public_name_still_imports() -> None:
    import lily_mongo

    for name in lily_mongo.__all__:
        assert getattr(lily_mongo, name) is not None, name
    assert set(lily_mongo.__all__) <= set(dir(lily_mongo))
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        lily_mongo.Nope  # noqa: B018


@pytest.mark.parametrize("arguments", [["--version"], ["run", "--version"], ["dlq", "list", "--version"]])
def test_version_is_answered_on_every_subcommand_without_loading_the_commands(arguments: list[str]) -> None:
    probe = (
        "import sys, json\nsys.argv = ['lily-mongo', *json.loads(sys.argv[1])]\n"
        "from lily_mongo.cli import main\nmain()\nprint(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, json.dumps(arguments)], check=True, capture_output=True, text=True
    ).stdout
    first, modules = out.splitlines()[0], set(json.loads(out.splitlines()[-1]))
    assert first == f"lily-mongo {importlib.metadata.version('lily-mongo')}"
    assert heavy(modules) == []


def test_help_loads_the_commands_but_not_pymongo_or_the_amqp_client() -> None:
    probe = (
        "import sys, json\nsys.argv = ['lily-mongo', '--help']\nfrom lily_mongo.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\nprint(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    modules = set(json.loads(out.splitlines()[-1]))
    assert "lily_mongo._cli.app" in modules
    assert {"pymongo", "aio_pika", "aiormq", "opentelemetry", "aiohttp", "mongoeco"} & modules == set()
