"""Child process for the `once` crash test.

``python once_worker.py URL EVENT_ID WORK_MS LEASE_SECONDS``: calls a `once` function for
the event, which INCRs ``runs:<event>`` and then works for WORK_MS before returning.
"""

from __future__ import annotations

import asyncio
import sys

from goblin_idem import RedisStore, once


async def main(url: str, event_id: str, work_ms: int, lease_seconds: int) -> None:
    store = RedisStore.from_url(url)

    @once(store, key=lambda event: event["id"], lease_seconds=lease_seconds, name="charge")
    async def charge(event: dict[str, str]) -> dict[str, int]:
        runs = await store.client.incr("runs:" + event["id"])
        await asyncio.sleep(work_ms / 1000)
        return {"run": runs}

    try:
        await charge({"id": event_id})
    finally:
        await store.aclose()


if __name__ == "__main__":
    url, event_id, work_ms, lease = sys.argv[1:5]
    asyncio.run(main(url, event_id, int(work_ms), int(lease)))
