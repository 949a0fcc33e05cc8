"""The command's exit statuses (docs/operations.md, section 8): one table, imported by every command and by
the ``--workers`` supervisor."""

from __future__ import annotations

import enum

__all__ = ["EXIT_CODES", "ExitCode"]


class ExitCode(enum.IntEnum):
    """The command's exit status (also in ``--help`` and docs/operations.md)."""

    OK = 0
    FAILED = 1  # the command ran and failed (a failed or forced shutdown, a ledger mismatch, nothing to replay)
    USAGE = 2  # bad usage: an option, a target that is not a Consumer, a plan error, a queue that does not exist
    UNAVAILABLE = 3  # RabbitMQ or MongoDB unreachable, refusing the login or virtual host, or without transactions
    INTERRUPTED = 130  # run: SIGINT or SIGTERM before the consumer had started (it stopped cleanly)


EXIT_CODES = (
    "Exit status: 0 success; 1 the command failed (run: a forced or failed shutdown); 2 bad usage (an option, "
    "a target that is not a Consumer, an invalid plan, a queue that does not exist); 3 RabbitMQ or MongoDB "
    "unreachable or refusing the connection; 130 run was stopped by a signal while starting. Errors are one "
    "line on stderr; --debug adds the traceback."
)
