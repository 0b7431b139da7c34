"""What the replay cache costs the server: its tracking table, per key and per first run.

    python3 bench/tracking_memory.py        # --keys 20000 --servers redis,valkey

For each server kind, a throwaway server on a free loopback port (stopped by PID at the
end) and a `RedisStore` with the replay cache on. `--keys` keys are run to completion
(`claim_unless_done`, then `publish`: a first run each), then each is asked once more, as
a duplicate, whose read of the store fills the cache. After each step the server's
`tracking_total_keys` and `used_memory` (INFO) are read, and the same is done with the
cache off: the first step says what first runs leave in the tracking table (beside the
keys they store), the second what each key that had a duplicate costs there (its result
and its claim are tracked). As in
http_bench.py, `PYTHONPATH=<other checkout>` measures another version of goblin-idem.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULT = b'{"status":201,"body":"{\\"id\\":1,\\"status\\":\\"created\\"}"}'
BUDGET = 64 << 20  # room for every key's entry in this process


def figures(server: Any) -> tuple[int, int]:
    """The server's tracked keys and used memory, once its memory figure has settled."""
    with server.sync_client() as client:
        stats = client.info("stats")
        memory = client.info("memory")
    return int(stats["tracking_total_keys"]), int(memory["used_memory"])


async def measure(kind: str, n: int, budget: int) -> dict[str, int]:
    """`n` first runs, then a duplicate of each, by a store with a replay cache of
    `budget` bytes (0: off): the server's tracked keys and used memory before and after
    each step."""
    from goblin_idem import CLAIMED, RedisStore
    from goblin_idem._keys import key_names
    from tests.support.servers import start_server

    server = start_server(kind)
    store = RedisStore.from_url(server.url, replay_cache_bytes=budget)
    try:
        await store.detect()
        names = [key_names(b"idem", b"", b"k%d" % i) for i in range(n)]
        row = {"keys": n}
        row["tracked_empty"], row["memory_empty"] = figures(server)

        async def first_run(i: int) -> None:
            k = names[i]
            assert await store.claim_unless_done(k.claim, k.result, b"t", 3600) is CLAIMED
            await store.publish(k.result, RESULT, 3_600_000, k.claim, b"t")

        async def duplicate(i: int) -> None:
            k = names[i]
            assert await store.claim_unless_done(k.claim, k.result, b"u", 3600) == RESULT

        for start in range(0, n, 100):
            await asyncio.gather(*(first_run(i) for i in range(start, min(n, start + 100))))
        row["tracked_first"], row["memory_first"] = figures(server)
        for start in range(0, n, 100):
            await asyncio.gather(*(duplicate(i) for i in range(start, min(n, start + 100))))
        if budget:  # every duplicate's fill in (each key kept: the budget has room)
            pipeline: Any = store._executor.replays
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while sum(pipeline.cached(k.result) is not None for k in names) < n:
                if loop.time() > deadline:
                    raise SystemExit("the duplicates' fills did not all arrive within 60 s")
                await asyncio.sleep(0.01)
        row["tracked_dup"], row["memory_dup"] = figures(server)
        return row
    finally:
        await store.aclose()
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=20_000, help="keys run, then duplicated (20000)")
    p.add_argument("--servers", default="redis,valkey")
    args = p.parse_args()
    sys.path.append(str(ROOT))  # after PYTHONPATH, which may name another copy

    print(f"{args.keys:,} keys")
    print()
    print(
        "| server | cache | tracked after the first runs | server bytes per first run "
        "| tracked after a duplicate each | server bytes per duplicated key |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for kind in args.servers.split(","):
        for budget in (0, BUDGET):
            row = asyncio.run(measure(kind, args.keys, budget))
            n = row["keys"]
            first = row["tracked_first"] - row["tracked_empty"]
            total = row["tracked_dup"] - row["tracked_empty"]
            per_first = (row["memory_first"] - row["memory_empty"]) / n
            per_dup = (row["memory_dup"] - row["memory_first"]) / n
            cache = f"{budget >> 20} MiB" if budget else "off"
            print(
                f"| {kind} | {cache} | {first:,} | {per_first:,.1f} | {total:,} | {per_dup:,.1f} |"
            )


if __name__ == "__main__":
    main()
