"""What SIGTERM and SIGINT mean: one policy for a consumer, a relay and the command's worker supervisor.

The first signal asks for a graceful shutdown. A later signal forces it, but
only when it arrives at least :data:`FORCE_AFTER` seconds after the first:
signals closer together are one burst and count once. A terminal's Ctrl-C
reaches every process of the foreground group, and a launcher such as
``uv run`` forwards the SIGINT it received as well, so one key press often
arrives twice within milliseconds; it must not force. Pressing Ctrl-C again
a moment later does (docs/lifecycle.md, section 8).

:func:`signal_action` is the decision, pure; :class:`ShutdownSignals` applies it
to an event loop's signal handlers and calls back.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import signal
import time
from collections.abc import Callable, Sequence

__all__ = ["FORCE_AFTER", "ShutdownSignals", "SignalAction", "graceful_notice", "signal_action"]

log = logging.getLogger("lily_mongo")

FORCE_AFTER = 1.0
"""Seconds after the first signal before another one forces the shutdown."""

SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalAction(enum.Enum):
    """What one received signal does."""

    GRACEFUL = "graceful"  # the first signal: a graceful shutdown
    FORCE = "force"  # a later signal, far enough from the first: force it
    IGNORE = "ignore"  # part of the first signal's burst, or after the force: nothing more to do


def signal_action(first: float | None, now: float, *, forced: bool, force_after: float = FORCE_AFTER) -> SignalAction:
    """The action of a signal received at ``now``, the first one having come at ``first`` (None: none yet).

    Times are in seconds on one monotonic clock; ``forced`` says a signal already forced.
    """
    if first is None:
        return SignalAction.GRACEFUL
    if forced or now - first < force_after:
        return SignalAction.IGNORE
    return SignalAction.FORCE


def graceful_notice(seconds: float) -> str:
    """The line the first signal prints: how long a graceful shutdown may take, and how to force it."""
    return f"shutting down gracefully (up to {seconds:g} s); press Ctrl-C again to force"


class ShutdownSignals:
    """Applies :func:`signal_action` to SIGTERM and SIGINT: ``graceful()`` on the first, ``force()`` once after.

    ``notice`` is logged (WARNING, on the ``lily_mongo`` logger) with the first signal; it may be
    changed while installed, for instance once a start has completed. Callbacks run in the
    event loop's thread (``loop.add_signal_handler``), so they may touch asyncio objects.
    """

    def __init__(
        self,
        graceful: Callable[[], object],
        force: Callable[[], object],
        *,
        notice: str = "shutting down gracefully; press Ctrl-C again to force",
        force_after: float = FORCE_AFTER,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._graceful = graceful
        self._force = force
        self.notice = notice
        self._force_after = force_after
        self._clock = clock
        self._first: float | None = None
        self._forced = False

    @property
    def received(self) -> bool:
        """True once a first signal came."""
        return self._first is not None

    @property
    def forced(self) -> bool:
        """True once a signal forced the shutdown."""
        return self._forced

    def receive(self, signum: int) -> SignalAction:
        """Handle one signal now: decide, log, call back; returns the action taken."""
        now = self._clock()
        action = signal_action(self._first, now, forced=self._forced, force_after=self._force_after)
        name = _name(signum)
        if action is SignalAction.GRACEFUL:
            self._first = now
            log.warning("%s received: %s", name, self.notice, extra={"signal": name})
            self._graceful()
        elif action is SignalAction.FORCE:
            self._forced = True
            log.warning("%s received again: forcing the shutdown", name, extra={"signal": name})
            self._force()
        else:
            log.debug("%s ignored (within %g s of the first signal, or already forced)", name, self._force_after)
        return action

    def install(
        self, loop: asyncio.AbstractEventLoop | None = None, signals: Sequence[int] = SHUTDOWN_SIGNALS
    ) -> Callable[[], None]:
        """Handle ``signals`` on ``loop`` (the running one by default); returns the function that removes them.

        Once removed, the signals go back to Python's defaults, not to handlers installed before.
        """
        loop = loop or asyncio.get_running_loop()
        for signum in signals:
            loop.add_signal_handler(signum, self.receive, signum)

        def uninstall() -> None:
            for signum in signals:
                loop.remove_signal_handler(signum)

        return uninstall


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
