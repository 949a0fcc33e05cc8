"""The shutdown signals (docs/lifecycle.md): the first SIGTERM or SIGINT asks for a graceful shutdown,
the next one forces it; the handlers come off again. One function serves the consumer and the relay."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from lily_mongo._signals import install_signal_handlers


class Service:
    def __init__(self) -> None:
        self.calls: list[str] = []

    @property
    def shutdown_requested(self) -> bool:
        return bool(self.calls)

    def request_shutdown(self) -> None:
        self.calls.append("graceful")

    def request_force(self) -> None:
        self.calls.append("force")


async def delivered(sig: signal.Signals) -> None:
    os.kill(os.getpid(), sig)
    for _ in range(100):  # the loop runs the handler on its next turns
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_first_signal_is_graceful_and_the_next_ones_force(sig: signal.Signals) -> None:
    service = Service()

    async def main() -> None:
        uninstall = install_signal_handlers(service)
        try:
            await delivered(sig)
            assert service.calls == ["graceful"]
            await delivered(sig)
            await delivered(signal.SIGTERM)
            assert service.calls == ["graceful", "force", "force"]
        finally:
            uninstall()
        assert not asyncio.get_running_loop().remove_signal_handler(sig)  # nothing left installed

    asyncio.run(main())


def test_a_shutdown_requested_otherwise_makes_the_first_signal_force() -> None:
    service = Service()
    service.request_shutdown()  # e.g. programmatically, before any signal

    async def main() -> None:
        uninstall = install_signal_handlers(service)
        try:
            await delivered(signal.SIGTERM)
        finally:
            uninstall()

    asyncio.run(main())
    assert service.calls == ["graceful", "force"]
