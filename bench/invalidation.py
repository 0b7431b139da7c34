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

With ``--from process`` the deletions come from another process (`forget` there), as an
operator's ``python -m goblin_idem forget`` or another app worker would send them: the time
from that process's reply to the entry's removal here (both read the system's monotonic
clock), negative when the entry was gone first. With ``--from forget`` they are
`goblin_idem.forget` called in this process, on another store: the entries are dropped
before its step returns (`forget_everywhere`), so the count still kept must be 0.

Usage: python bench/invalidation.py [--keys 2000] [--from client|process|forget]
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import sys
import time

from goblin_idem import CLAIMED, RedisStore, forget
from goblin_idem.inspection import names_for_hash
from tests.support.servers import running


def kept(store: RedisStore, result: bytes) -> bool:
    replays = store._executor.replays
    conn = None if replays is None else replays._conn
    return conn is not None and conn.cache is not None and result in conn.cache.entries


# The other process of ``--from process``: forgets each key hash read from stdin, and
# prints the monotonic time at which its reply came.
CHILD = """
import asyncio, sys, time
from goblin_idem import RedisStore, forget
from goblin_idem.inspection import names_for_hash

async def main(url):
    store = RedisStore.from_url(url)
    while line := sys.stdin.readline():  # not `for line in sys.stdin`: it reads ahead
        await forget(store, names=names_for_hash(line.strip()))
        print(time.monotonic(), flush=True)
    await store.aclose()

asyncio.run(main(sys.argv[1]))
"""


async def measure(url: str, keys: int, source: str) -> tuple[list[float], int]:
    store = RedisStore.from_url(url, replay_cache_bytes=4 << 20)
    other = RedisStore.from_url(url)
    child = None
    if source == "process":
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CHILD, url, stdin=-1, stdout=-1
        )
    try:
        names = []
        for _ in range(keys):
            n = names_for_hash(secrets.token_hex(16))  # as the other process names it
            assert await store.claim_unless_done(n.claim, n.result, "t", 30) is CLAIMED
            await store.publish(n.result, b"done", 600_000, n.claim, "t")
            assert kept(store, n.result)
            names.append(n)
        delays, late = [], 0
        for n in names:
            if child is not None:
                assert child.stdin is not None and child.stdout is not None
                child.stdin.write(n.hash.encode() + b"\n")
                line = asyncio.ensure_future(child.stdout.readline())
                gone = None
                while gone is None or not line.done():  # each loop turn is the measurement
                    if gone is None and not kept(store, n.result):
                        gone = time.monotonic()
                    await asyncio.sleep(0)
                replied = float(line.result())
                late += gone > replied  # still kept when the other process had its reply
                delays.append(gone - replied)
                continue
            if source == "forget":
                await forget(other, names=n)
            else:  # another connection: the server pushes to `store`
                await other.client.delete(n.result)
            replied = time.monotonic()
            late += kept(store, n.result)
            while kept(store, n.result):  # noqa: ASYNC110 - polling each loop turn is the measurement
                await asyncio.sleep(0)
            delays.append(time.monotonic() - replied)
        return delays, late
    finally:
        if child is not None and child.stdin is not None:
            child.stdin.close()
            await child.wait()
        await other.aclose()
        await store.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=2000)
    parser.add_argument("--from", dest="source", choices=("client", "process", "forget"))
    args = parser.parse_args()
    for kind in ("redis", "valkey"):
        with running(kind) as server:
            delays, late = asyncio.run(measure(server.url, args.keys, args.source or "client"))
        us = sorted(d * 1e6 for d in delays)
        p99 = us[min(len(us) - 1, int(len(us) * 0.99))]
        print(
            f"{kind} ({args.source or 'client'}): delete's reply -> entry gone, "
            f"{len(us)} keys: median "
            f"{statistics.median(us):.0f} us, p99 {p99:.0f} us, max {us[-1]:.0f} us; "
            f"still kept when the reply was read: {late}"
        )


if __name__ == "__main__":
    main()
