"""How long a full garbage collection takes with N completed keys held in a MemoryStore.

    python bench/gc_pause.py            # --keys 1000000 --rounds 5

Fills a MemoryStore the way the middleware does for each completed request (a claim, then
a publish of a result: two keys, each with a deadline), then times `gc.collect()` (a full
collection) with the store held and after dropping it, and counts what the collector
tracks. The difference between the two is what the held keys add to every full collection
of the process. No server, no network; the default collector settings.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from goblin_idem import MemoryStore

RESULT = b'{"status":201,"headers":[],"body":"{\\"id\\":1,\\"status\\":\\"created\\"}"}'


async def fill(store: MemoryStore, completed: int) -> None:
    for i in range(completed):
        claim, result = f"c:{i}", f"r:{i}"
        await store.claim(claim, result, b"token-0123456789abcdef", 30)
        await store.publish(result, RESULT, 86_400_000, claim, b"token-0123456789abcdef")


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
    asyncio.run(fill(store, args.keys))
    fill_s = time.perf_counter() - started
    gc.collect()
    held_ms = full_collections(args.rounds)
    held_objects = len(gc.get_objects())
    entries = len(store)
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


if __name__ == "__main__":
    main()
