"""Child process for the Lock tests.

``python lock_holder.py URL NAME LEASE_MS HOLD_MS LOG_KEY``: takes the lock (blocking), logs
"enter <pid>" and "exit <pid>" to a Redis list around HOLD_MS of work, releases it.
"""

from __future__ import annotations

import asyncio
import os
import sys

from goblin_idem import Lock, RedisStore


async def main(url: str, name: str, lease_ms: int, hold_ms: int, log_key: str) -> None:
    store = RedisStore.from_url(url)
    try:
        async with Lock(store, name, lease_seconds=lease_ms / 1000, timeout=30):
            await store.client.rpush(log_key, f"enter {os.getpid()}")
            await asyncio.sleep(hold_ms / 1000)
            await store.client.rpush(log_key, f"exit {os.getpid()}")
    finally:
        await store.aclose()


if __name__ == "__main__":
    url, name, lease, hold, log_key = sys.argv[1:6]
    asyncio.run(main(url, name, int(lease), int(hold), log_key))
