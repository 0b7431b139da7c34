"""Memory: what a completed key costs in Redis, that MemoryStore does not grow without
bound, and what an evicting maxmemory-policy does to completed keys.

Redis: N keys completed through the middleware (a 100-byte JSON body and two headers each);
the figures are the ``used_memory`` delta per key and ``MEMORY USAGE`` samples of the claim
and the result, each less the body. MemoryStore: waves of keys with a one-second TTL; once a
wave has expired, the next wave's writes reclaim it, so the entries held (and the memory
traced) stay at about one wave, however many waves pass.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time
import tracemalloc
from collections.abc import Callable
from typing import Literal

import pytest
from starlette.types import Receive, Scope, Send

from goblin_idem import IdempotencyMiddleware, MemoryStore, RedisStore
from goblin_idem._keys import key_names
from tests.reliability.report import mean, pick, record
from tests.support.asgi import request
from tests.support.servers import Server, start_server

REDIS_KEYS = pick(3_000, 100_000)
EVICTION_KEYS = pick(300, 3_000)
WAVE = pick(2_000, 10_000)
WAVES = pick(3, 10)
BODY_BYTES = 100
CONCURRENCY = 64


class FixedApp:
    """A 100-byte JSON body, content-type and content-length: a typical small API answer."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        key = scope["path"].rsplit("/", 1)[-1]
        body = json.dumps({"id": key, "status": "paid", "pad": ""}).encode()
        body = body[:-2] + b"x" * (BODY_BYTES - len(body)) + b'"}'
        assert len(body) == BODY_BYTES
        headers = [(b"content-type", b"application/json"), (b"content-length", b"100")]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def complete(mw: IdempotencyMiddleware, keys: list[str]) -> None:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(key: str) -> None:
        async with gate:
            reply = await request(mw, "POST", f"/orders/{key}", key=key, body=b"{}")
            assert reply.status == 201

    await asyncio.gather(*(one(k) for k in keys))


@pytest.mark.parametrize(
    "server", ["redis-script", "redis-native", "valkey-script", "valkey-native"]
)
async def test_redis_bytes_per_completed_key(
    modules_for: Callable[[str], list[str]], server: str
) -> None:
    kind, mode = server.split("-")
    srv = start_server(kind, modules=modules_for(mode))
    try:
        await _bytes_per_completed_key(srv, kind, mode)  # type: ignore[arg-type]
    finally:
        srv.stop()


async def _bytes_per_completed_key(
    srv: Server, kind: str, mode: Literal["script", "native"]
) -> None:
    store = RedisStore.from_url(srv.url, mode=mode)
    client = store.client
    mw = IdempotencyMiddleware(FixedApp(), store=store)
    keys = [f"mem-{i:07d}-{random.getrandbits(24):06x}" for i in range(REDIS_KEYS)]
    try:
        await complete(mw, keys[:10])  # scripts loaded, connections open
        await client.flushall()
        before = (await client.info("memory"))["used_memory"]
        started = time.monotonic()
        await complete(mw, keys)
        duration = time.monotonic() - started
        after = (await client.info("memory"))["used_memory"]
        dbsize = await client.dbsize()
        sample = random.sample(keys, min(500, len(keys)))
        usage_claim, usage_result, record_len = [], [], []
        for k in sample:
            names = key_names(b"idem", b"", k.encode())
            usage_claim.append(await client.memory_usage(names.claim, samples=0))
            usage_result.append(await client.memory_usage(names.result, samples=0))
            record_len.append(await client.strlen(names.result))
        info = await client.info("server")
        version = info.get("valkey_version") or info["redis_version"]
    finally:
        await store.aclose()

    per_key = (after - before) / REDIS_KEYS
    usage_pair = mean(usage_claim) + mean(usage_result)
    record(
        f"memory-{kind}-{mode}",
        f"Memory: {kind} ({mode} mode) bytes per completed key",
        {
            "server": f"{kind} {version}",
            "keys": REDIS_KEYS,
            "body_bytes": BODY_BYTES,
            "used_memory_delta_bytes": after - before,
            "used_memory_per_key": round(per_key, 1),
            "overhead_per_key_beyond_body_used_memory": round(per_key - BODY_BYTES, 1),
            "memory_usage_claim_avg": round(mean(usage_claim), 1),
            "memory_usage_result_avg": round(mean(usage_result), 1),
            "overhead_per_key_beyond_body_memory_usage": round(usage_pair - BODY_BYTES, 1),
            "stored_record_bytes_avg": round(mean(record_len), 1),
            "record_bytes_beyond_body": round(mean(record_len) - BODY_BYTES, 1),
            "overhead_per_key_beyond_record_used_memory": round(per_key - mean(record_len), 1),
            "fill_duration_s": round(duration, 2),
            "keys_per_s": round(REDIS_KEYS / duration),
        },
        checks=["2 keys per completed request (claim and result), nothing else stored"],
        notes=[
            "body: 100-byte JSON with content-type and content-length headers; "
            "MEMORY USAGE with SAMPLES 0 on 500 random keys",
            "the used_memory delta also carries the growth of the key and expiry tables "
            "(power-of-two sized), so it depends on the number of keys",
        ],
    )
    assert dbsize == 2 * REDIS_KEYS
    # A sanity bound, not a target (the used_memory delta also carries the key tables'
    # power-of-two growth, which dominates at small sizes).
    assert 0 < usage_pair - BODY_BYTES < 1000


async def test_memory_store_reclaims_expired_entries() -> None:
    store = MemoryStore()
    mw = IdempotencyMiddleware(FixedApp(), store=store, ttl_seconds=1, lease_seconds=2)
    held, traced, heap = [], [], []
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for wave in range(WAVES):
            await complete(mw, [f"w{wave}-{i}" for i in range(WAVE)])
            gc.collect()
            held.append(len(store))
            heap.append(sum(map(len, store._buckets.values())))
            traced.append(tracemalloc.get_traced_memory()[0] - base)
            await asyncio.sleep(1.05)  # this wave expires before the next one writes
        idle_len = len(store)
    finally:
        tracemalloc.stop()

    record(
        "memory-memorystore",
        "Memory: MemoryStore under waves of expiring keys",
        {
            "waves": WAVES,
            "keys_per_wave": WAVE,
            "keys_total": WAVES * WAVE,
            "ttl_s": 1,
            "entries_held_after_each_wave": held,
            "expiry_bucket_entries_after_each_wave": heap,
            "traced_kib_after_each_wave": [round(t / 1024) for t in traced],
            "entries_held_when_idle": idle_len,
        },
        checks=[
            "entries held after every wave <= 2 x wave + 64 (the live wave, not the total)",
            "traced memory after the last wave <= 1.5 x after the second",
        ],
        notes=[
            "expired entries are reclaimed lazily, up to 64 per write; an idle store keeps "
            "its last wave until it is written to again",
            "the expiry buckets keep each claim's lease-length entry until that deadline "
            "passes (lease_seconds = 2 here; 30 by default), so it holds about requests per "
            "lease on top of the live keys",
        ],
    )
    assert all(n <= 2 * WAVE + 64 for n in held), held
    assert traced[-1] <= 1.5 * traced[1], traced


async def test_eviction_under_allkeys_lru(own_redis: Server) -> None:
    store = RedisStore.from_url(own_redis.url, mode="script")
    client = store.client
    handler = FixedApp()
    runs: list[str] = []

    async def counting(scope: Scope, receive: Receive, send: Send) -> None:
        runs.append(scope["path"].rsplit("/", 1)[-1])
        await handler(scope, receive, send)

    mw = IdempotencyMiddleware(counting, store=store)
    keys = [f"ev-{i:05d}" for i in range(EVICTION_KEYS)]
    try:
        await store.detect()
        await complete(mw, keys)
        runs.clear()
        used = (await client.info("memory"))["used_memory"]
        await client.config_set("maxmemory-policy", "allkeys-lru")
        await client.config_set("maxmemory", used + 256 * 1024)
        filler = b"f" * 1024
        written = 0
        while (await client.info("stats"))["evicted_keys"] < EVICTION_KEYS and written < 50_000:
            pipe = client.pipeline(transaction=False)
            for i in range(written, written + 200):
                pipe.set(f"filler-{i}", filler)
            await pipe.execute()
            written += 200
        evicted = (await client.info("stats"))["evicted_keys"]
        await client.config_set("maxmemory", 0)  # the answers below evict nothing more
        survived = {}
        for k in keys:
            names = key_names(b"idem", b"", k.encode())
            survived[k] = (await client.exists(names.claim), await client.exists(names.result))
        answers = {}
        for k in keys:
            reply = await request(mw, "POST", f"/orders/{k}", key=k, body=b"{}")
            replayed = reply.header("idempotent-replayed") == b"true"
            answers[k] = "replay" if replayed else ("run" if reply.status == 201 else "409")
    finally:
        await store.aclose()

    expected = {
        k: "replay" if result else ("409" if claim else "run")
        for k, (claim, result) in survived.items()
    }
    pairs = list(survived.values())
    record(
        "memory-eviction",
        "Memory: completed keys under maxmemory-policy allkeys-lru",
        {
            "keys": EVICTION_KEYS,
            "filler_keys_written": written,
            "evicted_keys": evicted,
            "claim_and_result_kept": pairs.count((1, 1)),
            "result_kept_claim_evicted": pairs.count((0, 1)),
            "claim_kept_result_evicted": pairs.count((1, 0)),
            "both_evicted": pairs.count((0, 0)),
            "replayed": list(answers.values()).count("replay"),
            "ran_again": len(runs),
            "in_flight_409": list(answers.values()).count("409"),
        },
        checks=[
            "every key whose result survived is replayed, its claim evicted or not",
            "a key whose claim survived without its result answers 409 (until the claim's "
            "TTL ends); a key that lost both runs again",
        ],
        notes=[
            f"{EVICTION_KEYS} keys completed, then maxmemory set 256 KiB above the memory in "
            "use and 1 KiB filler values written until the server had evicted as many keys",
        ],
    )
    assert answers == expected
    assert sorted(runs) == sorted(k for k, a in expected.items() if a == "run")
