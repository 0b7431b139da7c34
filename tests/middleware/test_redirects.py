"""Redirects through the middleware, end to end: a FastAPI app under uvicorn on redis-server,
called by httpx following redirects with the same Idempotency-Key."""

from __future__ import annotations

import httpx

from tests.support.procs import APPS, start_uvicorn, stop
from tests.support.servers import Server, free_port

BODY = b'{"amount": 100}'


async def test_a_redirect_that_repeats_the_request_elsewhere_is_not_stored(
    redis_server: Server,
) -> None:
    """307 (FastAPI's answer to a route hit without its trailing slash) and 308 ask the
    client to send the same request to another URL: the key is released, so the request
    that follows them runs the handler, once, and its 201 is what duplicates replay."""
    client = redis_server.client()
    await client.flushall()
    port = free_port()
    proc = start_uvicorn(port, {"REDIS_URL": redis_server.url}, app=f"{APPS}.redirect_app:app")
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", follow_redirects=True, timeout=10
        ) as http:
            for path, status, key in (("/orders", 307, "k-slash"), ("/old-orders", 308, "k-moved")):
                headers = {"Idempotency-Key": key}
                first = await http.post(path, content=BODY, headers=headers)
                assert [r.status_code for r in first.history] == [status]
                assert first.status_code == 201, first.text
                assert "idempotent-replayed" not in first.headers
                again = await http.post("/orders/", content=BODY, headers=headers)
                assert again.status_code == 201 and again.content == first.content
                assert again.headers["idempotent-replayed"] == "true"
                # The whole call repeated: its first hop finds the key answered for the
                # URL it redirected to (another path, so another request), and runs nothing.
                repeated = await http.post(path, content=BODY, headers=headers)
                assert repeated.status_code == 422 and not repeated.history
                assert repeated.json()["type"] == "urn:goblin-idem:problem:key-reused"
            counters = (await http.get("/stats")).json()
        assert await client.get("runs:orders") == b"2"
        assert (counters["released"], counters["replayed"]) == (2, 2)
    finally:
        stop(proc)
        await client.aclose()
