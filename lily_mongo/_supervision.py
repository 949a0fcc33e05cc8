"""What every supervised service (a consumer, a relay) shares: its lifecycle state, its shutdown steps, and
the report they make (docs/lifecycle.md, section 6)."""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from ._errors import LilyError

log = logging.getLogger("lily_mongo")


class State(enum.Enum):
    """Lifecycle states of a consumer, in order; a consumer starts once."""

    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    FORCING = "forcing"
    STOPPED = "stopped"


_ORDER = {state: position for position, state in enumerate(State)}


class Lifecycle:
    """The one holder of a consumer's lifecycle state, shared by the :class:`Consumer` and the
    :class:`ManagedConsumer` it starts. The state only moves forward (a failed start moves
    from starting to stopped, a graceful shutdown skips forcing)."""

    __slots__ = ("state",)

    def __init__(self, state: State = State.NEW) -> None:
        self.state = state

    def enter(self, state: State) -> None:
        if _ORDER[state] <= _ORDER[self.state]:
            raise LilyError(f"the consumer cannot go back from {self.state.value} to {state.value}")
        self.state = state


@dataclass(frozen=True, slots=True)
class ShutdownAction:
    """One shutdown step: did it return OK, was the dependency's termination observed."""

    name: str
    ok: bool
    observed: bool
    error: str | None = None
    duration: float = 0.0


@dataclass(frozen=True, slots=True)
class ShutdownReport:
    """What shutdown did. ``succeeded`` only if every step returned OK, every
    termination was observed and no delivery was left unresolved; ``forced`` when the
    graceful window did not settle every delivery; :attr:`graceful` when both went well."""

    actions: tuple[ShutdownAction, ...]
    settled: Mapping[str, int]
    unresolved: int
    forced: bool
    succeeded: bool
    totals: Mapping[str, int] = field(default_factory=dict)
    """The run's totals: a consumer's deliveries by terminal outcome, a relay's records published (and
    refused as unroutable), from start to stop; the report's last line."""
    elapsed: float = 0.0  # seconds from start to the end of the shutdown

    @property
    def graceful(self) -> bool:
        """True when the shutdown succeeded within the graceful window, without forcing: the one outcome
        ``lily-mongo run`` exits 0 after."""
        return self.succeeded and not self.forced

    def action(self, name: str) -> ShutdownAction:
        """The action called ``name`` (KeyError if the shutdown did not run it)."""
        for action in self.actions:
            if action.name == name:
                return action
        raise KeyError(name)

    def render(self) -> str:
        """A human-readable multi-line summary (no endpoints, no credentials)."""
        if self.graceful:
            status = "succeeded"
        elif self.succeeded:  # forced, yet everything settled (after the force notice)
            status = "FORCED"
        else:
            status = "FAILED (forced)" if self.forced else "FAILED"
        lines = [f"shutdown {status}; unresolved deliveries: {self.unresolved}"]
        for a in self.actions:
            status = ("ok" if a.ok else "error") + (", terminated" if a.observed else ", termination NOT observed")
            lines.append(f"  {a.name:<18} {status} ({a.duration:.3f} s){': ' + a.error if a.error else ''}")
        if self.settled:
            lines.append("  settled during shutdown: " + ", ".join(f"{k}={v}" for k, v in sorted(self.settled.items())))
        lines.append(render_totals(self.totals, self.elapsed))
        return "\n".join(lines)


def render_totals(totals: Mapping[str, int], elapsed: float) -> str:
    """The report's last line: ``run totals: acked=880, duplicate=120 in 42.0 s`` (``none`` for an idle run)."""
    counts = ", ".join(f"{k}={v}" for k, v in sorted(totals.items()) if v) or "none"
    return f"run totals: {counts} in {elapsed:.1f} s"


class ShutdownSteps:
    def __init__(self) -> None:
        self.actions: list[ShutdownAction] = []

    async def run(self, name: str, step: Callable[[], Awaitable[bool]]) -> bool:
        started = time.monotonic()
        try:
            observed = await step()
        except Exception as exc:
            self.actions.append(
                ShutdownAction(name, False, False, f"{type(exc).__name__}: {exc}"[:300], time.monotonic() - started)
            )
            log.warning("shutdown step %s failed: %s", name, type(exc).__name__, extra={"step": name})
            return False
        self.actions.append(ShutdownAction(name, True, observed, None, time.monotonic() - started))
        # Incomplete: for the drain, the graceful window did not settle everything; for the
        # others, the dependency's termination was not observed.
        log.log(
            logging.INFO if observed else logging.WARNING,
            "shutdown step %s: %s (%.3f s)",
            name,
            "complete" if observed else "incomplete",
            time.monotonic() - started,
            extra={"step": name},
        )
        return observed
