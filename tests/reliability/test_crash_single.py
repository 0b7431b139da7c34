"""A uvicorn worker killed mid-handler: duplicates get 409 until its lease expires, then one
retry runs the work once."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx

from tests.support.procs import start_uvicorn, stop
from tests.support.servers import Server, free_port


async def test_worker_killed_mid_handler(redis_server: Server) -> None:
    client = redis_server.client()
    await client.flushall()
    env = {"REDIS_URL": redis_server.url, "LEASE_SECONDS": "2"}
    port = free_port()
    worker = start_uvicorn(port, env)
    replacement = None
    url = f"http://127.0.0.1:{port}/task/charge"
    headers = {"Idempotency-Key": "order-1"}
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            slow = {**headers, "X-Work-Ms": "60000"}
            doomed = asyncio.create_task(http.post(url, headers=slow))
            for _ in range(500):
                if await client.get("runs:charge") is not None:
                    break
                await asyncio.sleep(0.02)
            stop(worker, signal.SIGKILL)
            killed_at = time.monotonic()
            await asyncio.gather(doomed, return_exceptions=True)

            replacement = start_uvicorn(port, env)
            statuses = []
            while True:
                reply = await http.post(url, headers=headers)
                if reply.status_code != 409:
                    break
                assert reply.headers["retry-after"] == "1"
                statuses.append(reply.status_code)
                await asyncio.sleep(0.1)
            # It was 409 until the lease (2 s after the last renewal) ran out ...
            assert statuses and time.monotonic() - killed_at >= 1.0
            assert time.monotonic() - killed_at < 4.0  # ... and not stuck beyond it
            # ... then exactly one retry ran the work.
            assert reply.status_code == 201 and reply.json() == {"run": 2}
            again = await http.post(url, headers=headers)
            assert again.json() == {"run": 2}
            assert again.headers["idempotent-replayed"] == "true"
            assert await client.get("runs:charge") == b"2"
    finally:
        stop(worker)
        if replacement is not None:
            stop(replacement)
        await client.aclose()
