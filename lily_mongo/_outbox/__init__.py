"""The transactional outbox: records written in a transaction, dispatched after its commit, a backstop relay
(docs/outbox.md).

* :class:`OutboxWriter` (``writer``: a handler's ``mongo.outbox``, ``tx.publish_*`` in
  :meth:`Outbox.transaction`) inserts one record per message in the transaction.
  With a dispatcher running, the record is born claimed by it (owner, token,
  expiry), so no relay publishes it while its writer is dispatching.
* :class:`OutboxDispatcher` (``dispatcher``) takes a committed transaction's records from
  memory right after the commit, publishes them pipelined on one confirming channel
  (``publishing``: many publishes in flight, their confirms awaited together) and marks
  them published in batches, across transactions (``outcomes``): one ``update_many`` for
  many records.
* :class:`OutboxRelay` (``relay``), the backstop, claims due records in batches (find
  the ids, claim them in one ``update_many`` with a fresh token, read them back),
  publishes them pipelined and marks them in one write. Several relays share the
  work: every write of a claim holder is fenced by its token.
* :class:`ProcessOutbox` (``process``) is one process's outbox: the writers' factory,
  the dispatcher, the relay and their shared counters.
* :class:`Outbox` (``standalone``) is the standalone outbox for code outside handlers:
  ``await outbox.transaction(fn)``; :class:`Relay` (``service``) the backstop relay as a
  service of its own (``lily-mongo relay``).

Every write on the outbox collection outside a transaction is acknowledged by a
majority whatever the client's default; the read that decides an unknown commit
uses majority read concern. The record protocol (filters, updates, the failure
rule, the order) is :mod:`.protocol`; the options are :mod:`.options`.
"""

from __future__ import annotations

from .dispatcher import OutboxDispatcher
from .options import OutboxOptions, standalone_options
from .outcomes import OutboxCounters
from .process import ProcessOutbox
from .publishing import FixedTransport, Send
from .relay import OutboxRelay
from .service import Relay
from .standalone import Outbox, OutboxTransaction
from .writer import OutboxWriter

__all__ = [
    "FixedTransport",
    "Outbox",
    "OutboxCounters",
    "OutboxDispatcher",
    "OutboxOptions",
    "OutboxRelay",
    "OutboxTransaction",
    "OutboxWriter",
    "ProcessOutbox",
    "Relay",
    "Send",
    "standalone_options",
]
