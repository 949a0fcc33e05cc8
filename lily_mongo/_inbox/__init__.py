"""The inbox: one record per (handler, event) carries the lease and the completion (docs/inbox.md).

:class:`Inbox` (``inbox``) runs a delivery under the record protocol (``protocol``: its updates,
their transitions and the decisions, pure): the lease claim, releases and counts outside
transactions (``store``), the attempts in transactions (``attempts``), the heartbeat
(``heartbeat``), each wait bounded (``lease``). The handler's view of an attempt is
:class:`MongoScope` (``scope``); the options are :class:`InboxOptions` (``options``);
``lily-mongo inbox stats`` reads ``stats``.
"""

from __future__ import annotations

from .attempts import Invoke
from .inbox import Inbox
from .options import InboxOptions
from .scope import MongoDatabase, MongoScope
from .stats import STAT_COLUMNS, inbox_stats

__all__ = ["STAT_COLUMNS", "Inbox", "InboxOptions", "Invoke", "MongoDatabase", "MongoScope", "inbox_stats"]
