"""The consumer and its supervisor (docs/lifecycle.md).

:class:`Consumer` (``consumer``) collects the plan; :meth:`Consumer.start` declares the
topology, attaches consumers and returns a :class:`ManagedConsumer` (``managed``) whose
supervisor task owns every resource and every task until shutdown completes.

Cancellation rules:

* cancelling the task awaiting :meth:`Consumer.start` tears down whatever had
  started, then the cancellation propagates;
* cancelling the task awaiting :meth:`Consumer.run` (or
  :meth:`Consumer.run_with_cancellation`) requests a graceful shutdown, waits
  for it to complete, then propagates;
* cancelling :meth:`ManagedConsumer.wait` or :meth:`ManagedConsumer.shutdown`
  only stops that waiter: the supervisor goes on and can be awaited again.
"""

from __future__ import annotations

from .consumer import Consumer, QueueSettings
from .managed import ManagedConsumer

__all__ = ["Consumer", "ManagedConsumer", "QueueSettings"]
