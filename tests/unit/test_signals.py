"""The signal policy: the first signal is graceful, a burst counts once, a later one (>= 1 s) forces."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from lily_mongo._signals import ShutdownSignals, SignalAction, graceful_notice, signal_action

GRACEFUL, FORCE, IGNORE = SignalAction.GRACEFUL, SignalAction.FORCE, SignalAction.IGNORE


@pytest.mark.parametrize(
    ("first", "now", "forced", "expected"),
    [
        (None, 5.0, False, GRACEFUL),  # the first signal
        (5.0, 5.0, False, IGNORE),  # the same key press, forwarded by a launcher
        (5.0, 5.999, False, IGNORE),  # still the burst
        (5.0, 6.0, False, FORCE),  # one second later: the user pressed again
        (5.0, 60.0, False, FORCE),
        (5.0, 60.0, True, IGNORE),  # already forced: nothing more to do
    ],
)
def test_signal_action(first: float | None, now: float, forced: bool, expected: SignalAction) -> None:
    assert signal_action(first, now, forced=forced) is expected


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_counts_once_and_a_later_signal_forces_once() -> None:
    calls: list[str] = []
    clock = Clock()
    signals = ShutdownSignals(lambda: calls.append("graceful"), lambda: calls.append("force"), clock=clock)
    assert signals.receive(signal.SIGINT) is GRACEFUL
    clock.now += 0.01
    assert signals.receive(signal.SIGINT) is IGNORE  # the terminal's and uv's copies of one Ctrl-C
    clock.now += 0.5
    assert signals.receive(signal.SIGTERM) is IGNORE
    assert calls == ["graceful"]
    assert not signals.forced
    clock.now += 1.0  # 1.51 s after the first
    assert signals.receive(signal.SIGTERM) is FORCE
    clock.now += 5.0
    assert signals.receive(signal.SIGINT) is IGNORE
    assert calls == ["graceful", "force"]
    assert signals.forced


def test_the_first_signal_logs_the_notice(caplog: pytest.LogCaptureFixture) -> None:
    signals = ShutdownSignals(lambda: None, lambda: None, notice=graceful_notice(30.0))
    with caplog.at_level("WARNING", logger="lily_mongo"):
        signals.receive(signal.SIGTERM)
    assert caplog.messages == ["SIGTERM received: shutting down gracefully (up to 30 s); press Ctrl-C again to force"]


async def test_installed_handlers_receive_real_signals_and_uninstall() -> None:
    got: list[str] = []
    done = asyncio.Event()

    def graceful() -> None:
        got.append("graceful")
        done.set()

    uninstall = ShutdownSignals(graceful, lambda: got.append("force")).install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(done.wait(), 5)
        os.kill(os.getpid(), signal.SIGTERM)  # within the burst: ignored
        await asyncio.sleep(0.05)
    finally:
        uninstall()
    assert got == ["graceful"]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
