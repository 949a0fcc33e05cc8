"""Time :func:`lily_mongo.envelope.validate_envelope` on a typical delivery.

Run: ``python benchmarks/bench_envelope.py [--runs 7] [--calls 50000]``

Prints the median cost per call over several runs, next to a baseline measured
in the same process (reading the same headers from the dict and parsing the
event id with ``uuid.UUID``), and their ratio, so figures from different
machines can be compared. Standard library only (``timeit`` turns the garbage
collector off while timing).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import timeit
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lily_mongo.envelope import validate_envelope

TARGET_US = 10.0

# What a publish_json delivery carries: the three envelope headers, a retry
# count (a retried copy) and W3C trace context.
HEADERS: dict[str, object] = {
    "x-lily-event-id": "0f8fad5b-d9cb-469f-a165-70867728950e",
    "x-lily-schema-version": "1",
    "x-lily-content-kind": "json",
    "x-retry-count": 2,
    "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "tracestate": "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE",
}
BODY_SIZE = 1_024


def envelope_call() -> None:
    validate_envelope(HEADERS, BODY_SIZE)


def baseline_call() -> None:
    # The least a consumer must do anyway: read the headers and parse the id.
    headers = HEADERS
    uuid.UUID(headers["x-lily-event-id"])  # type: ignore[arg-type]
    headers.get("x-lily-schema-version")
    headers.get("x-lily-content-kind")
    headers.get("x-retry-count")
    headers.get("traceparent")
    headers.get("tracestate")


def median_us(call: Callable[[], None], runs: int, calls: int) -> tuple[float, float]:
    """Median and best microseconds per call over ``runs`` runs of ``calls`` calls."""
    call()  # warm up caches (compiled regexes, attribute lookups)
    totals = timeit.repeat(call, number=calls, repeat=runs)
    per_call = [total / calls * 1e6 for total in totals]
    return statistics.median(per_call), min(per_call)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=7, help="timed runs (default 7)")
    parser.add_argument("--calls", type=int, default=50_000, help="calls per run (default 50000)")
    args = parser.parse_args(argv)

    envelope = validate_envelope(HEADERS, BODY_SIZE)
    if envelope.retry_count != 2 or envelope.traceparent is None:
        # Timing a rejection or a dropped trace would measure the wrong path.
        raise SystemExit(f"unexpected envelope for the typical delivery: {envelope!r}")

    print(
        f"python {platform.python_version()} ({platform.python_implementation()}) on {platform.machine()}; "
        f"{args.runs} runs x {args.calls} calls; {len(HEADERS)} headers incl. traceparent"
    )
    env_median, env_best = median_us(envelope_call, args.runs, args.calls)
    base_median, base_best = median_us(baseline_call, args.runs, args.calls)
    ratio = env_median / base_median if base_median else float("inf")
    verdict = "within" if env_median <= TARGET_US else "OVER"
    print(
        f"validate_envelope median: {env_median:.2f} us/call (best {env_best:.2f}; target <= {TARGET_US:g} us, "
        f"{verdict}); baseline (dict lookups + uuid.UUID) median: {base_median:.2f} us/call "
        f"(best {base_best:.2f}); ratio {ratio:.1f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
