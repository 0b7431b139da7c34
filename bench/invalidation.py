"""How long a replay cache keeps answering after another client deleted the key.

For each server kind (Redis 7, Valkey 9) a throwaway server is started (the test suite's,
on a free loopback port, stopped by PID at the end). A RedisStore publishes `--keys` keys,
so each is kept in its replay cache; then, one key at a time, another client of the same
process deletes it, and the store's event loop runs until the server's invalidation has
removed the entry. Reported: the time from the DEL's reply to the entry's removal, median,
p99 and max, and for how many keys the entry was still there when the DEL's reply was read
(a duplicate asked at that moment would have been answered from memory).

The figure is the bound docs/guarantees.md states: it is one trip of the invalidation over
the loopback, plus the wait for the event loop to read it; a busy loop or a remote server
adds to it.

Usage: python bench/invalidation.py [--keys 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics

from goblin_idem import CLAIMED, RedisStore
from tests.support.servers import running


def kept(store: RedisStore, result: bytes) -> bool:
    replays = store._executor.replays
    conn = None if replays is None else replays._conn
    return conn is not None and conn.cache is not None and result in conn.cache.entries


async def measure(url: str, keys: int) -> tuple[list[float], int]:
    store = RedisStore.from_url(url, replay_cache_bytes=4 << 20)
    other = RedisStore.from_url(url)
    loop = asyncio.get_running_loop()
    try:
        names = []
        for _ in range(keys):
            tag = secrets.token_hex(8)
            claim, result = f"{{{tag}}}:c".encode(), f"{{{tag}}}:r".encode()
            assert await store.claim_unless_done(claim, result, "t", 30) is CLAIMED
            await store.publish(result, b"done", 600_000, claim, "t")
            assert kept(store, result)
            names.append(result)
        delays, late = [], 0
        for result in names:
            await other.client.delete(result)  # another connection: the server pushes to `store`
            replied = loop.time()
            late += kept(store, result)
            while kept(store, result):  # noqa: ASYNC110 - polling each loop turn is the measurement
                await asyncio.sleep(0)
            delays.append(loop.time() - replied)
        return delays, late
    finally:
        await other.aclose()
        await store.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=2000)
    args = parser.parse_args()
    for kind in ("redis", "valkey"):
        with running(kind) as server:
            delays, late = asyncio.run(measure(server.url, args.keys))
        us = sorted(d * 1e6 for d in delays)
        p99 = us[min(len(us) - 1, int(len(us) * 0.99))]
        print(
            f"{kind}: DEL reply -> entry gone, {len(us)} keys: median "
            f"{statistics.median(us):.0f} us, p99 {p99:.0f} us, max {us[-1]:.0f} us; "
            f"still kept when the DEL reply was read: {late}"
        )


if __name__ == "__main__":
    main()
