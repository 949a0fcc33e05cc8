"""The one backoff rule: exponential, capped, with "equal jitter".

Every wait before trying again uses it: an inbox replay and a commit retry
(``InboxOptions.backoff_base``/``backoff_max``, docs/inbox.md), the pause before
a deferred or handed-off delivery is requeued (docs/settlement.md, section 4)
and an outbox record's next publish attempt (``OutboxOptions``, docs/outbox.md).
"""

from __future__ import annotations

__all__ = ["backoff"]

# Doublings past this many leave every step at its cap for any base >= 2**-1000 s, and
# keep ``2.0 ** retry`` finite (a deferral count may reach 10 000).
_MAX_DOUBLINGS = 1000


def backoff(retry: int, *, base: float, cap: float, jitter: float) -> float:
    """Seconds to wait before the next try; ``retry`` counts the tries waited for before it (0 first).

    The step is ``base * 2**retry``, capped at ``cap``; the delay is at least half the
    step, so a try never follows at once, and spread over the other half by ``jitter``
    (drawn from [0, 1)) so tries of many deliveries do not align.
    """
    step: float = min(cap, base * 2.0 ** min(retry, _MAX_DOUBLINGS))
    return step / 2 + step / 2 * jitter
