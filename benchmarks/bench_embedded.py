"""The embedded MongoDB's cost as its collections grow: the server lily runs against mongoeco as it ships.

Run: ``python benchmarks/bench_embedded.py [--sizes 1000 5000 20000] [--shipped-sizes 1000 5000]
[--rounds 3] [--blocks 10] [--json]``

Two contenders, each a fresh server process per round (rounds alternate their order):

* ``lily``: ``python -m lily_mongo.embedded`` (the server the tests, the demo and
  ``lily-mongo embedded`` run: mongoeco with lily's corrections, docs/emulator.md);
* ``shipped``: ``python -m lily_mongo.embedded --as-shipped`` (mongoeco 4.11 as it ships).

Against each, this process (a PyMongo client, the same for both) makes one pair of
collections per size, shaped and indexed as lily's (the outbox's with its three
indexes, ``lily_outbox_due``, ``lily_outbox_failed`` and ``lily_expires_at_ttl``; the
inbox records with ``lily_purge_at_ttl``), filled mostly with published records and
completed records as a running service leaves them. After one warm-up pass, the
measures run in blocks, each block visiting every size in turn (the first size
rotating), so the machine's noise falls on every size alike:

* ``outbox insert``: ``insert_one`` of a pending outbox record (``new_record``), per second;
* ``inbox claim``: a first-time copy's claim and commit (``find_one_and_update`` of
  ``first_claim_update`` with ``upsert=True`` in a transaction, then ``commitTransaction``),
  per second;
* ``mark 100``: the dispatcher's mark of 100 published records, one ``update_many`` by
  ``_id`` (``mark_filter``, ``mark_update``), milliseconds per call;
* ``due query``: the relay's poll for due records (``due_filter``, ``DUE_SORT``, limit 100)
  while 1,100 pending records are claimed by their writer and none is due, milliseconds per call.

Each block makes 20 inserts, 20 claims, one mark and 2 due queries per size.
Beside each figure, the server process's CPU per operation (``/proc``). The
figures are medians over rounds; the growth ratios (the figure at the largest size
over the figure at the smallest) and the lily/shipped ratio at each size shared by
both are medians of per-round ratios. mongoeco as it ships compares every inserted
``_id`` with every stored one, so filling it to 20,000 documents takes about half an
hour per round: its default sizes stop at 5,000 (``--shipped-sizes`` to change).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pymongo import MongoClient, ReturnDocument
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lily_mongo._inbox.first_claim import first_claim_update
from lily_mongo._inbox.protocol import record_key
from lily_mongo._outbox.protocol import (
    DUE_SORT,
    FAILED,
    PENDING,
    PUBLISHED,
    Claim,
    due_filter,
    mark_filter,
    mark_update,
    new_record,
)

CONTENDERS = ("lily", "shipped")
LABELS = {"lily": "lily_mongo.embedded", "shipped": "mongoeco as it ships"}
MEASURES = ("outbox insert", "inbox claim", "mark 100", "due query")
UNITS = {"outbox insert": "/s", "inbox claim": "/s", "mark 100": "ms", "due query": "ms"}
HANDLER = "bench.orders/v1/record_order"
OWNER = "bench-owner"
FILL_BATCH = 100  # one insert_many; mongoeco as it ships serves it without yielding, so keep it short
INSERTS = 20  # single inserts and claims per block and size
MARKED = 100  # records one mark publishes (one update_many per block and size)
QUERIES = 2  # due queries per block and size


def server_cpu(pid: int) -> float:
    """The server process's user + system CPU seconds so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


class Server:
    """``python -m lily_mongo.embedded`` in its own process, for one round of one contender."""

    def __init__(self, contender: str) -> None:
        command = [sys.executable, "-m", "lily_mongo.embedded", "--port", "0"]
        if contender == "shipped":
            command.append("--as-shipped")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.startswith("READY "):
            raise SystemExit(f"the embedded server did not start: {line!r}")
        self.uri = line.split(None, 1)[1].strip()

    def cpu(self) -> float:
        return server_cpu(self.process.pid)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


def outbox_record(seq: int, now: datetime.datetime, *, status: str) -> dict[str, Any]:
    record = new_record(
        record_id=uuid.uuid4().hex,
        event_id=str(uuid.uuid4()),
        exchange="bench",
        routing_key="orders.created",
        body=b'{"order_id": "o-1", "amount": 500}',
        headers={"x-lily-event-id": str(uuid.uuid4())},
        content_type="application/json",
        writer=HANDLER,
        written_at=now,
        seq=seq,
        # Claimed by its writer's dispatcher for a day: never due while the benchmark runs (a
        # healthy service's relay poll finds nothing due; it costs the walk of the candidates).
        claim=Claim(OWNER, "token-1", now + datetime.timedelta(days=1)) if status == PENDING else None,
    )
    if status == PUBLISHED:
        record.update(status=PUBLISHED, published_at=now, expires_at=now + datetime.timedelta(days=7))
    return record


def inbox_record(now: datetime.datetime) -> dict[str, Any]:
    event_id = str(uuid.uuid4())
    return {
        "_id": record_key(HANDLER, event_id),
        **first_claim_update(HANDLER, event_id, OWNER, now=now, retention_seconds=7 * 86400)["$setOnInsert"],
    }


class Collections:
    """The two collections of one size, with lily's indexes (lily_mongo.outbox, lily_mongo.inbox)."""

    def __init__(self, client: MongoClient[Any], size: int, blocks: int) -> None:
        database = client[f"bench_embedded_{size}"]
        self.client = client
        self.outbox = database["lily_outbox"]
        self.records = database["lily_inbox"]
        self.outbox.create_index(
            [("status", 1), ("available_at", 1), ("seq", 1)],
            name="lily_outbox_due",
            partialFilterExpression={"status": PENDING},
        )
        self.outbox.create_index([("status", 1)], name="lily_outbox_failed", partialFilterExpression={"status": FAILED})
        self.outbox.create_index([("expires_at", 1)], name="lily_expires_at_ttl", expireAfterSeconds=0)
        self.records.create_index([("purge_at", 1)], name="lily_purge_at_ttl", expireAfterSeconds=0)
        now = datetime.datetime.now(datetime.UTC)
        # The records the marks publish, 100 per block: pending and claimed, as the dispatcher leaves them.
        self.pending = [outbox_record(seq, now, status=PENDING) for seq in range(MARKED * blocks)]
        self.outbox.insert_many(self.pending)
        self.marks = iter(range(blocks))
        count = len(self.pending)
        while count < size:  # published outbox records and completed inbox records, as a service leaves them
            batch = min(FILL_BATCH, size - count)
            self.outbox.insert_many([outbox_record(0, now, status=PUBLISHED) for _ in range(batch)])
            self.records.insert_many([inbox_record(now) for _ in range(batch)])
            count += batch

    def insert(self) -> None:
        self.outbox.insert_one(outbox_record(0, datetime.datetime.now(datetime.UTC), status=PENDING))

    def claim(self) -> None:
        event_id = str(uuid.uuid4())
        now = datetime.datetime.now(datetime.UTC)
        update = first_claim_update(HANDLER, event_id, OWNER, now=now, retention_seconds=7 * 86400)
        with self.client.start_session(causal_consistency=False) as session:
            session.start_transaction(read_concern=ReadConcern("snapshot"), write_concern=WriteConcern("majority"))
            self.records.find_one_and_update(
                {"_id": record_key(HANDLER, event_id)},
                update,
                upsert=True,
                return_document=ReturnDocument.BEFORE,
                session=session,
            )
            session.commit_transaction()

    def mark(self) -> None:
        block = next(self.marks)
        ids = [record["_id"] for record in self.pending[block * MARKED : (block + 1) * MARKED]]
        result = self.outbox.update_many(mark_filter(ids, "token-1"), mark_update(retention_seconds=600))
        if result.modified_count != len(ids):
            raise SystemExit(f"the mark changed {result.modified_count} of {len(ids)} records")

    def due(self) -> None:
        soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
        list(self.outbox.find(due_filter(soon)).sort(DUE_SORT).limit(100))


class Tally:
    """One measure at one size: operations, their wall time and the server's CPU time."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.cpu = 0.0

    def time(self, server: Server, operation: Callable[[], None], count: int) -> None:
        cpu = server.cpu()
        started = time.perf_counter()
        for _ in range(count):
            operation()
        self.seconds += time.perf_counter() - started
        self.cpu += server.cpu() - cpu
        self.count += count

    def figures(self, unit: str) -> dict[str, float]:
        value = self.count / self.seconds if unit == "/s" else self.seconds / self.count * 1000
        return {"value": value, "server_cpu_us": self.cpu / self.count * 1e6}


def run(contender: str, sizes: list[int], blocks: int) -> dict[int, dict[str, dict[str, float]]]:
    """One round of one contender: a fresh server holding one pair of collections per size, then the
    measures in blocks, each block visiting every size (so the machine's noise falls on all sizes alike)."""
    server = Server(contender)
    try:
        client: MongoClient[Any] = MongoClient(server.uri, serverSelectionTimeoutMS=10_000)
        try:
            started = time.perf_counter()
            by_size = {size: Collections(client, size, blocks + 1) for size in sizes}
            print(f"  {contender:<7} filled {sizes} in {time.perf_counter() - started:.0f} s", flush=True)
            tallies = {size: {name: Tally() for name in MEASURES} for size in sizes}
            operations: dict[str, tuple[Callable[[Collections], Callable[[], None]], int]] = {
                "outbox insert": (lambda c: c.insert, INSERTS),
                "inbox claim": (lambda c: c.claim, INSERTS),
                "mark 100": (lambda c: c.mark, 1),
                "due query": (lambda c: c.due, QUERIES),
            }
            warm = Tally()  # the server's first filters, sorts and updates, not counted
            for name, (pick, count) in operations.items():
                warm.time(server, pick(by_size[sizes[0]]), 1 if name == "mark 100" else count)
            for block in range(blocks):
                order = sizes[block % len(sizes) :] + sizes[: block % len(sizes)]
                for size in order:
                    for name, (pick, count) in operations.items():
                        tallies[size][name].time(server, pick(by_size[size]), count)
            results = {size: {name: tallies[size][name].figures(UNITS[name]) for name in MEASURES} for size in sizes}
            for size in sizes:
                shown = ", ".join(f"{name} {results[size][name]['value']:.1f} {UNITS[name]}" for name in MEASURES)
                print(f"  {contender:<7} at {size:>6}: {shown}", flush=True)
            return results
        finally:
            client.close()
    finally:
        server.stop()


def ratio(value: float, other: float, unit: str) -> float:
    """How much better ``value`` is than ``other``: >1 is faster (a rate higher, a time lower)."""
    return value / other if unit == "/s" else other / value


def summarise(rounds: list[dict[str, dict[int, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    sizes = {"lily": args.sizes, "shipped": args.shipped_sizes}
    summary: dict[str, Any] = {"figures": {}, "growth": {}, "lily_over_shipped": {}}
    for contender in CONTENDERS:
        summary["figures"][contender] = {
            size: {
                name: {
                    key: statistics.median(r[contender][size][name][key] for r in rounds)
                    for key in ("value", "server_cpu_us")
                }
                for name in MEASURES
            }
            for size in sizes[contender]
        }
        low, high = min(sizes[contender]), max(sizes[contender])
        summary["growth"][contender] = {
            "sizes": [low, high],
            **{
                name: statistics.median(
                    r[contender][high][name]["value"] / r[contender][low][name]["value"] for r in rounds
                )
                for name in MEASURES
            },
        }
    for size in sorted(set(args.sizes) & set(args.shipped_sizes)):
        summary["lily_over_shipped"][size] = {
            name: statistics.median(
                ratio(r["lily"][size][name]["value"], r["shipped"][size][name]["value"], UNITS[name]) for r in rounds
            )
            for name in MEASURES
        }
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    print("\nmedians of rounds; server CPU per operation in brackets")
    for contender in CONTENDERS:
        print(f"{LABELS[contender]}:")
        for size, figures in summary["figures"][contender].items():
            shown = "  ".join(
                f"{name} {f['value']:8.1f} {UNITS[name]:<2} ({f['server_cpu_us']:7.0f} us)"
                for name, f in figures.items()
            )
            print(f"  {size:>6} documents: {shown}")
    print("\ngrowth: the figure at the largest size over the figure at the smallest (median of per-round ratios)")
    for contender in CONTENDERS:
        growth = dict(summary["growth"][contender])
        low, high = growth.pop("sizes")
        shown = ", ".join(f"{name} {value:.2f}x" for name, value in growth.items())
        print(f"  {LABELS[contender]:<22} {high}/{low}: {shown}")
    print("  (done when: lily's insert rates at 20,000 >= 0.7x their rate at 1,000; its mark 100 <= 3x)")
    for size, ratios in summary["lily_over_shipped"].items():
        shown = ", ".join(f"{name} {value:.1f}x" for name, value in ratios.items())
        print(f"lily / shipped at {size} documents (>1: lily faster): {shown}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 20000], help="lily's sizes")
    parser.add_argument("--shipped-sizes", type=int, nargs="+", default=[1000, 5000], help="the shipped server's sizes")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of one run per contender (default 3)")
    parser.add_argument("--blocks", type=int, default=10, help="measuring blocks per run (default 10)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON after the table")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.blocks < 1 or min(args.sizes + args.shipped_sizes) < 1:
        parser.error("--rounds, --blocks and every size must be >= 1")
    args.sizes, args.shipped_sizes = sorted(set(args.sizes)), sorted(set(args.shipped_sizes))
    print(
        f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs; {args.rounds} rounds "
        f"(order alternating); lily at {args.sizes}, shipped at {args.shipped_sizes} documents per collection",
        flush=True,
    )
    rounds: list[dict[str, dict[int, Any]]] = []
    for round_ in range(1, args.rounds + 1):
        print(f"round {round_}", flush=True)
        order = CONTENDERS if round_ % 2 else CONTENDERS[::-1]
        rounds.append({c: run(c, args.sizes if c == "lily" else args.shipped_sizes, args.blocks) for c in order})
    summary = summarise(rounds, args)
    print_summary(summary)
    if args.json:
        print(json.dumps({"summary": summary, "rounds": rounds}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
