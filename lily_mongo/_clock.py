"""Times as MongoDB and this process read them: aware UTC datetimes, and the offset between the two clocks.

PyMongo returns naive UTC datetimes unless the client is ``tz_aware``; every comparison goes
through :func:`aware`. Records written without ``$$NOW`` carry this process's clock corrected by
its offset to the server's (:func:`clock_offset`, from a reply's ``localTime``).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

__all__ = ["Clock", "aware", "clock_offset", "utcnow"]

Clock = Callable[[], datetime.datetime]
"""Where a time is read from: this process's clock, corrected by its offset to the server's."""


def utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def aware(value: object) -> datetime.datetime | None:
    """``value`` as an aware UTC datetime (a naive one is UTC); None when it is not a datetime."""
    if not isinstance(value, datetime.datetime):
        return None
    return value if value.tzinfo is not None else value.replace(tzinfo=datetime.UTC)


def clock_offset(server_time: object, sent: datetime.datetime, received: datetime.datetime) -> datetime.timedelta:
    """The server clock minus this process's, from a reply's server time read between ``sent`` and ``received``.

    Zero when the reply carries no time. The round trip's midpoint stands for the
    moment the server read its clock (an error of at most half the round trip).
    """
    server = aware(server_time)
    if server is None:
        return datetime.timedelta(0)
    return server - (sent + (received - sent) / 2)
