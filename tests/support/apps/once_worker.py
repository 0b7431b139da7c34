"""Child process for the `once` crash and pause tests.

``python once_worker.py URL EVENT_ID WORK_MS LEASE_SECONDS [OUT]``: calls a `once` function
for the event, which INCRs ``runs:<event>`` and then works for WORK_MS before returning;
the value the call returned is written to the file OUT (as JSON), if given.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from goblin_idem import RedisStore, once


async def main(url: str, event_id: str, work_ms: int, lease_seconds: int) -> dict[str, int]:
    store = RedisStore.from_url(url)

    @once(store, key=lambda event: event["id"], lease_seconds=lease_seconds, name="charge")
    async def charge(event: dict[str, str]) -> dict[str, int]:
        runs = await store.client.incr("runs:" + event["id"])
        await asyncio.sleep(work_ms / 1000)
        return {"run": runs}

    try:
        return await charge({"id": event_id})
    finally:
        await store.aclose()


if __name__ == "__main__":
    url, event_id, work_ms, lease, *out = sys.argv[1:]
    value = asyncio.run(main(url, event_id, int(work_ms), int(lease)))
    if out:
        Path(out[0]).write_text(json.dumps(value), encoding="utf-8")
