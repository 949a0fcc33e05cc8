"""The broker tier: the same flows on every RabbitMQ the suite runs on, with classic and quorum queues.

The brokers come from ``LILY_BROKERS``, a comma-separated list of ``name=url`` entries;
``scripts/brokers.sh status --env`` prints the one for the brokers that script runs
(RabbitMQ 4.3, 4.0 and a three-node 4.3 cluster) and the broker of ``LILY_AMQP_URL``
(``system``)::

    scripts/brokers.sh up
    export "$(scripts/brokers.sh status --env)"
    bash scripts/test.sh -m broker

Without ``LILY_BROKERS`` every test here is skipped, so the rest of the suite needs
nothing beyond its one broker; a listed broker that does not answer is skipped too,
or fails the run when ``LILY_BROKERS_REQUIRED=1`` (what CI sets).

The ``amqp`` fixture here takes the place of the suite-wide one, so every fixture built
on it (``broker``, ``names``, ``amqp_connection``) talks to the broker of the test's
parameter. ``queue_type`` gives each test both queue types; ``rabbitmq`` is the broker's
version as it reports it.
"""

from __future__ import annotations

import collections
import os
import socket
from collections.abc import Generator
from dataclasses import dataclass

import pytest
from yarl import URL

from lily_mongo._plan.options import QueueType
from tests.brokers.tier import RabbitMQ, server_properties
from tests.integration.conftest import _abandoned_mongo_sockets  # noqa: F401  (autouse, as in the integration tier)

BROKERS_VARIABLE = "LILY_BROKERS"
REQUIRED_VARIABLE = "LILY_BROKERS_REQUIRED"
# What scripts/brokers.sh runs, named as its `status --env` names them; the ids of the tests
# when LILY_BROKERS is not set (they are all skipped then).
DEFAULT_NAMES = ("system", "r43", "r40", "c43")


@dataclass(frozen=True)
class Target:
    name: str
    url: str | None  # None: not configured


def configured_targets() -> list[Target]:
    text = os.environ.get(BROKERS_VARIABLE, "").strip()
    if not text:
        return [Target(name, None) for name in DEFAULT_NAMES]
    targets: list[Target] = []
    for entry in text.split(","):
        name, sep, url = entry.strip().partition("=")
        if not sep or not name or not url.startswith(("amqp://", "amqps://")):
            raise pytest.UsageError(
                f"{BROKERS_VARIABLE}: entry {entry!r} is not name=amqp://...; "
                f"expected a comma-separated list such as system=amqp://guest:guest@127.0.0.1:5672/"
            )
        if any(t.name == name for t in targets):
            raise pytest.UsageError(f"{BROKERS_VARIABLE}: broker {name!r} is listed twice")
        targets.append(Target(name, url))
    return targets


TARGETS = configured_targets()


def unavailable(reason: str) -> None:
    if os.environ.get(REQUIRED_VARIABLE) == "1":
        pytest.fail(f"{reason} ({REQUIRED_VARIABLE}=1)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session", params=TARGETS, ids=[t.name for t in TARGETS])
def amqp(request: pytest.FixtureRequest) -> str:
    """The URL of the broker this test runs on (one parameter per entry of LILY_BROKERS)."""
    target: Target = request.param
    if target.url is None:
        pytest.skip(
            f"{BROKERS_VARIABLE} is not set: the broker tier runs on the brokers listed there "
            f'(scripts/brokers.sh up; export "$(scripts/brokers.sh status --env)"; see CONTRIBUTING.md)'
        )
    url = URL(target.url)
    try:
        socket.create_connection((url.host or "127.0.0.1", url.port or 5672), timeout=3).close()
    except OSError as error:
        unavailable(f"broker {target.name} at {url.host}:{url.port} does not answer ({error}): scripts/brokers.sh up")
    return target.url


@pytest.fixture(scope="session")
def rabbitmq(amqp: str) -> RabbitMQ:
    """The version of the test's broker, as it reports it."""
    return RabbitMQ.of(amqp, server_properties(URL(amqp)))


@pytest.fixture(params=["classic", "quorum"])
def queue_type(request: pytest.FixtureRequest) -> QueueType:
    """The type of the queues the test declares (its work queue, retry buckets, DLQ and destinations)."""
    chosen: QueueType = request.param
    return chosen


# -- what each broker's share of the run took -------------------------------------------------------

_seconds: dict[str, float] = collections.defaultdict(float)  # seconds per broker
_outcomes: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    callspec = getattr(item, "callspec", None)
    target = callspec.params.get("amqp") if callspec is not None else None
    if isinstance(target, Target):
        _seconds[target.name] += report.duration
        if report.failed:
            _outcomes[target.name]["failed"] += 1
        elif report.skipped:
            _outcomes[target.name]["skipped"] += 1
        elif report.when == "call":
            _outcomes[target.name]["passed"] += 1
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line per broker of the tier: its version, its tests' outcomes and their time (setup included)."""
    if not _seconds:
        return
    terminalreporter.section("broker tier, by broker")
    for target in TARGETS:
        if target.name not in _seconds:
            continue
        try:
            version = str(server_properties(URL(target.url)).get("version", "?")) if target.url else "not set"
        except OSError:
            version = "not answering"
        counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(_outcomes[target.name].items()))
        where = URL(target.url).with_user(None).with_password(None) if target.url else "-"
        terminalreporter.write_line(
            f"{target.name:<8} RabbitMQ {version:<14} {where}  {counts}  in {_seconds[target.name]:.1f} s"
        )
