"""The shutdown signals of a long-running service: SIGTERM/SIGINT, first graceful, then forced.

One rule for every service the command line runs (``lily-mongo run``'s consumer,
``lily-mongo relay``'s relay, docs/lifecycle.md): each gives its shutdown requests
and this module maps the signals to them.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import Protocol

__all__ = ["Stoppable", "install_signal_handlers"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stoppable(Protocol):
    """A service that can be asked to shut down, gracefully or by force."""

    @property
    def shutdown_requested(self) -> bool: ...

    def request_shutdown(self) -> None: ...

    def request_force(self) -> None: ...


def install_signal_handlers(service: Stoppable, loop: asyncio.AbstractEventLoop | None = None) -> Callable[[], None]:
    """SIGTERM/SIGINT: the first asks ``service`` for a graceful shutdown, the next one forces it.

    Returns the function that removes the handlers again.
    """
    loop = loop or asyncio.get_running_loop()

    def on_signal() -> None:
        if service.shutdown_requested:
            service.request_force()
        else:
            service.request_shutdown()

    for sig in SIGNALS:
        loop.add_signal_handler(sig, on_signal)

    def uninstall() -> None:
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)

    return uninstall
