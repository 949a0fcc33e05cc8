"""Time how long the package and the command take to start, in fresh processes.

Run: ``python benchmarks/bench_startup.py [--runs 10]``

Each case runs ``--runs`` times, each in a new interpreter (nothing cached in the process:
the operating system's file cache is warm after the first run, as on a developer's machine),
and prints the median and the best wall time, next to the interpreter's own start
(``python -c pass``) measured the same way. The targets: ``import lily_mongo`` at most 0.5 s,
``lily-mongo --version`` at most 0.3 s (median); the other cases are there to compare.
Exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (what, command, target in seconds or None)
CASES: list[tuple[str, list[str], float | None]] = [
    ("python -c pass", [sys.executable, "-c", "pass"], None),
    ("import lily_mongo", [sys.executable, "-c", "import lily_mongo"], 0.5),
    ("lily-mongo --version", [sys.executable, "-c", "from lily_mongo.cli import main; main()", "--version"], 0.3),
    (
        "lily-mongo run --version",
        [sys.executable, "-c", "from lily_mongo.cli import main; main()", "run", "--version"],
        0.3,
    ),
    ("from lily_mongo import Consumer", [sys.executable, "-c", "from lily_mongo import Consumer"], None),
    ("lily-mongo --help", [sys.executable, "-c", "from lily_mongo.cli import main; main()", "--help"], None),
]


def wall_times(command: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - started)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="fresh processes per case (default 10)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    script = shutil.which("lily-mongo")
    print(f"{'case':<34} {'median':>8} {'best':>8}  target")
    missed = []
    for what, command, target in CASES:
        times = wall_times(command, args.runs)
        median = statistics.median(times)
        verdict = "" if target is None else f"<= {target:.1f} s: " + ("met" if median <= target else "MISSED")
        print(f"{what:<34} {median:>7.3f}s {min(times):>7.3f}s  {verdict}")
        if target is not None and median > target:
            missed.append(what)
    if script is not None:  # the installed entry point's own wrapper, for comparison
        times = wall_times([script, "--version"], args.runs)
        print(f"{'lily-mongo --version (script)':<34} {statistics.median(times):>7.3f}s {min(times):>7.3f}s")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
