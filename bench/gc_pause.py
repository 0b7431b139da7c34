"""What N completed keys held in a MemoryStore cost the rest of the process: the length
of a full garbage collection, and the longest single store call while they were written.

    python bench/gc_pause.py            # --keys 1000000 --rounds 5
    PYTHONPATH=<other checkout> python bench/gc_pause.py    # another version of the store

Fills a MemoryStore the way the middleware does for each completed request (a claim, then
a publish of a result: two keys, each with a deadline), then times `gc.collect()` (a full
collection) with the store held and after dropping it, and counts what the collector
tracks. The difference between the two is what the held keys add to every full collection
of the process. During the fill (the collector off, so that only the store's own work is
timed) it times every store call on the thread's CPU clock (time the machine's other work
takes is not counted) and reports the longest: a call that grows a dict copies the whole
dict, and every request of the process waits for it. The largest
table the store holds (the most entries one such copy can move) is the deterministic
figure beside it. No server, no network; the default collector settings.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH's copy

from goblin_idem import MemoryStore

RESULT = b'{"status":201,"headers":[],"body":"{\\"id\\":1,\\"status\\":\\"created\\"}"}'
TOKEN = b"token-0123456789abcdef"


async def fill(store: MemoryStore, completed: int) -> tuple[float, int]:
    """Milliseconds of the longest store call (thread CPU time), and the pair it was in."""
    clock = time.thread_time_ns
    longest, at = 0, 0
    for i in range(completed):
        claim, result = f"c:{i}", f"r:{i}"
        started = clock()
        await store.claim(claim, result, TOKEN, 30)
        claimed = clock()
        await store.publish(result, RESULT, 86_400_000, claim, TOKEN)
        took = max(claimed - started, clock() - claimed)
        if took > longest:
            longest, at = took, i
    return longest / 1e6, at


def largest_table(store: MemoryStore) -> int:
    """Entries of the largest dict the store holds, directly or in a tuple or list."""
    sizes = [0]
    for value in vars(store).values():
        tables: Any = value.values() if type(value) is dict else [value]
        if isinstance(value, tuple | list):
            tables = value
        for table in [value, *tables]:
            if type(table) is dict:
                sizes.append(len(table))
    return max(sizes)


def full_collections(rounds: int) -> float:
    """Median milliseconds of one gc.collect()."""
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=1_000_000, help="completed keys (1000000)")
    p.add_argument("--rounds", type=int, default=5, help="collections timed (5)")
    args = p.parse_args()

    gc.collect()
    empty_ms = full_collections(args.rounds)
    empty_objects = len(gc.get_objects())
    store = MemoryStore()
    started = time.perf_counter()
    gc.disable()  # a collection during a call is the store's neighbours' cost, timed below
    longest_ms, longest_at = asyncio.run(fill(store, args.keys))
    gc.enable()
    fill_s = time.perf_counter() - started
    gc.collect()
    held_ms = full_collections(args.rounds)
    held_objects = len(gc.get_objects())
    entries, largest = len(store), largest_table(store)
    del store
    gc.collect()
    after_ms = full_collections(args.rounds)

    print(
        f"Python {sys.version.split()[0]}, {args.keys:,} completed keys "
        f"({entries:,} entries), median of {args.rounds} gc.collect()"
    )
    print()
    print("| | full collection ms | objects tracked |")
    print("|---|---:|---:|")
    print(f"| before the store | {empty_ms:.2f} | {empty_objects:,} |")
    print(f"| store held | {held_ms:.2f} | {held_objects:,} |")
    print(f"| store dropped | {after_ms:.2f} | {len(gc.get_objects()):,} |")
    print()
    print(
        f"added by the held keys: {held_ms - after_ms:.2f} ms per full collection, "
        f"{held_objects - empty_objects:,} tracked objects; fill {fill_s:.1f} s"
    )
    print(
        f"longest store call: {longest_ms:.2f} ms of CPU (pair {longest_at:,}); "
        f"largest table: {largest:,} entries"
    )


if __name__ == "__main__":
    main()
