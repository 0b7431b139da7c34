"""Redirects through the middleware, end to end: a FastAPI app under uvicorn on redis-server,
called by httpx following redirects with the same Idempotency-Key; a repeated call that
follows the same redirect ends at the replay (middleware/_hops.py)."""

from __future__ import annotations

import httpx
import redis
from flask import Flask
from starlette.types import Receive, Scope, Send

from goblin_idem import IdempotencyMiddleware, RedisStore, forget
from goblin_idem._keys import hop_key, key_names
from goblin_idem.flask import Idempotency
from tests.support.asgi import request
from tests.support.procs import APPS, start_uvicorn, stop
from tests.support.servers import Server, free_port
from tests.support.wsgi import call

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
                # The whole call repeated: its first hop gets the redirect replayed, and
                # following it, the replay of the request it led to; nothing runs.
                repeated = await http.post(path, content=BODY, headers=headers)
                assert [r.status_code for r in repeated.history] == [status]
                assert repeated.history[0].headers["idempotent-replayed"] == "true"
                assert repeated.history[0].headers["location"].endswith("/orders/")
                assert repeated.status_code == 201 and repeated.content == first.content
                assert repeated.headers["idempotent-replayed"] == "true"
                # The key sent with another body: the redirect does not answer it (422).
                other = await http.post(path, content=b'{"amount": 999}', headers=headers)
                assert other.status_code == 422 and not other.history
                assert other.json()["type"] == "urn:goblin-idem:problem:key-reused"
            counters = (await http.get("/stats")).json()
        assert await client.get("runs:orders") == b"2"
        assert (counters["released"], counters["replayed"]) == (2, 6)
        assert counters["mismatch"] == 2
    finally:
        stop(proc)
        await client.aclose()


async def test_a_chain_of_redirects_sealed_in_process(redis_server: Server) -> None:
    """Two hops (a moved route's 308, then a trailing slash's 307), each remembered, sealed
    for the hop key: the repeated call follows both again to the replay. Driven hop by hop,
    as a client following redirects sends them."""
    await redis_server.client().flushall()
    runs: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        hops = {"/old": (308, b"/orders"), "/orders": (307, b"/orders/")}
        if scope["path"] in hops:
            status, location = hops[scope["path"]]
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [(b"location", location)],
                }
            )
            await send({"type": "http.response.body", "body": b""})
            return
        runs.append(scope["path"])
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": f"run {len(runs)}".encode()})

    store = RedisStore.from_url(redis_server.url)
    mw = IdempotencyMiddleware(app, store=store, encryption_keys=[bytes(range(32))])
    try:
        for attempt in range(2):
            path, answers = "/old", []
            while True:
                reply = await request(mw, "POST", path, key="chain", body=BODY)
                answers.append((reply.status, reply.header("idempotent-replayed")))
                if reply.status not in (307, 308):
                    break
                path = (reply.header("location") or b"").decode()
            assert reply.body == b"run 1"
            replayed = None if attempt == 0 else b"true"
            assert answers == [(308, replayed), (307, replayed), (201, replayed)]
        names = key_names(b"idem", b"", b"chain")
        assert b"/orders" not in (await store.get(hop_key(names)) or b"/orders")  # sealed
        assert runs == ["/orders/"]
        assert await forget(store, "chain")
        assert await store.get(hop_key(names)) is None
    finally:
        await store.aclose()


def test_flask_repeats_its_slash_redirect(redis_server: Server) -> None:
    """Flask answers 308 to a route declared with its trailing slash: through the WSGI
    adapter, the repeated request gets that redirect replayed, then the replay."""
    redis.Redis.from_url(redis_server.url).flushall()
    app = Flask(__name__)
    runs: list[int] = []

    @app.post("/orders/")
    def create() -> tuple[str, int]:
        runs.append(1)
        return f"run {len(runs)}", 201

    Idempotency(app, store=RedisStore.from_url(redis_server.url))
    for attempt in range(2):
        hop = call(app.wsgi_app, "POST", "/orders", BODY, key="flask-slash")
        assert hop.code == 308 and (hop.header("Location") or "").endswith("/orders/")
        done = call(app.wsgi_app, "POST", "/orders/", BODY, key="flask-slash")
        assert done.code == 201 and done.body == b"run 1"
        replayed = "true" if attempt else None
        assert hop.header("Idempotent-Replayed") == done.header("Idempotent-Replayed") == replayed
    assert runs == [1]
