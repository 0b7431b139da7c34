"""`goblin_idem.forget` and `Store.forget` without SQL records (tests/sql/test_forget.py has
them with records): the claim, the result and the redirects go together in one step, only
while no run holds the claim, on every store; a run that lands just before the step, or
races it, is never left with a claim and no result (409 for a day)."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from goblin_idem import CLAIMED, InFlightError, MemoryStore, RedisStore, forget
from goblin_idem._keys import KeyNames, failures_key, hop_key, key_names
from goblin_idem.store import Published, Store
from tests.store.test_replay_cache import BUDGET
from tests.support.proxy import Proxy
from tests.support.servers import Server, start_cluster
from tests.support.waits import until

TTL_MS = 86_400_000


def names(key: str) -> KeyNames:
    return key_names(b"idem", b"", key.encode())


async def run_to_completion(store: Store, n: KeyNames, token: bytes = b"run-1") -> None:
    """A key's first run: claim, then publish (which extends the claim to the result's TTL)."""
    assert await store.claim_unless_done(n.claim, n.result, token, 30) is CLAIMED
    assert await store.publish(n.result, b"GI-answer", TTL_MS, n.claim, token) is Published.STORED


async def state(store: Store, n: KeyNames) -> tuple[bool, bool, bool]:
    return (
        await store.get(n.claim) is not None,
        await store.get(n.result) is not None,
        await store.get(hop_key(n)) is not None,
    )


# -- Store.forget, on every store -----------------------------------------------------------


async def test_a_completed_key_loses_claim_result_and_redirects_together(store: Store) -> None:
    n = names("done")
    await run_to_completion(store, n)
    await store.set(hop_key(n), b"redirects", px=TTL_MS)
    assert await store.forget(n.claim, n.result, hop_key(n)) == 3
    assert await state(store, n) == (False, False, False)
    assert await store.forget(n.claim, n.result, hop_key(n)) == 0  # nothing left


async def test_forget_drops_a_consumers_failure_count_so_the_key_runs_again(
    store: Store,
) -> None:
    """A broker message dead-lettered after its failures is stored like a result; an operator
    who forgets the key wants its next delivery run, not dead-lettered again by the count."""
    n = names("dead")
    await run_to_completion(store, n)
    await store.set(failures_key(n), b'[5, "ValueError: boom"]', px=TTL_MS)
    assert await forget(store, names=n)
    assert await state(store, n) == (False, False, False)
    assert await store.get(failures_key(n)) is None


async def test_a_claim_a_run_holds_is_never_deleted(store: Store) -> None:
    """No result and a claim: a run is in flight. Nothing goes, the claim least of all (a
    DEL of it would let a second run start beside the first)."""
    n = names("running")
    assert await store.claim_unless_done(n.claim, n.result, b"run-1", 30) is CLAIMED
    await store.set(hop_key(n), b"redirects", px=TTL_MS)
    assert await store.forget(n.claim, n.result, hop_key(n)) == -1
    assert await store.forget(n.claim, n.result, hop_key(n), expected=b"run-2") == -1
    assert await state(store, n) == (True, False, True)
    assert await store.get(n.claim) == b"run-1"
    assert await store.claim_unless_done(n.claim, n.result, b"run-2", 30) is None


async def test_a_claim_holding_the_expected_token_goes_without_a_result(store: Store) -> None:
    """The caller saw the claim's run committed (its SQL record): that claim may go."""
    n = names("committed")
    assert await store.claim_unless_done(n.claim, n.result, b"run-1", 30) is CLAIMED
    assert await store.forget(n.claim, n.result, expected=b"run-1") == 1
    assert await store.claim_unless_done(n.claim, n.result, b"run-2", 30) is CLAIMED


async def test_a_result_whose_claim_is_gone_is_removed(store: Store) -> None:
    n = names("lost-claim")
    await store.set(n.result, b"GI-answer", px=TTL_MS)
    assert await store.forget(n.claim, n.result) == 1
    assert await store.claim_unless_done(n.claim, n.result, b"run-2", 30) is CLAIMED


# -- goblin_idem.forget against a concurrent first run -------------------------------------


class RunLandsFirst(RedisStore):
    """A store on which `land` (the key's first run, claiming, running and publishing
    through another client) happens right after forget's first call to the store about
    the key: the interleaving that left keys stuck 409 when forget read the claim, then
    deleted."""

    watched: bytes
    land: Callable[[], Awaitable[object]]
    landed = False

    async def _land(self, key: Any) -> None:
        if not self.landed and key == self.watched:
            self.landed = True
            await self.land()

    async def get(self, key: Any) -> bytes | None:
        value = await super().get(key)
        await self._land(key)
        return value

    async def forget(self, claim_key: Any, result_key: Any, *others: Any, **kw: Any) -> int:
        await self._land(claim_key)
        return await super().forget(claim_key, result_key, *others, **kw)


async def test_a_first_run_landing_as_forget_starts_is_never_left_holding_its_claim(
    redis_server: Server,
) -> None:
    store = RunLandsFirst.from_url(redis_server.url)
    other = RedisStore.from_url(redis_server.url)
    n = names(f"race-{secrets.token_hex(4)}")
    store.watched, store.land = n.claim, lambda: run_to_completion(other, n)
    try:
        assert await forget(store, names=n) is True
        assert store.landed
        # The run's result and claim went together: the key runs again, not 409 for a day.
        assert await state(store, n) == (False, False, False)
        assert await store.claim_unless_done(n.claim, n.result, b"run-2", 30) is CLAIMED
    finally:
        await store.aclose()
        await other.aclose()


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_forget_racing_first_runs_leaves_no_key_stuck(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """400 keys, each forgotten while its first run claims and publishes: afterwards every
    key either still answers with its result or is free; none holds a claim alone."""
    if kind == "memory":
        store: Store = MemoryStore()
        runner: Store = store
    else:
        url = request.getfixturevalue("redis_server").url
        store, runner = RedisStore.from_url(url), RedisStore.from_url(url)
    keys = [names(f"many-{secrets.token_hex(6)}") for _ in range(400)]

    async def one(i: int, n: KeyNames) -> None:
        async def race_forget() -> None:
            try:
                await forget(store, names=n)
            except InFlightError:
                pass  # the run held its claim with nothing stored: rightly refused

        async def run() -> None:
            for _ in range(i % 4):  # let forget's steps go first by 0 to 3 loop turns
                await asyncio.sleep(0)
            await run_to_completion(runner, n)

        await asyncio.gather(race_forget(), run())

    try:
        await asyncio.gather(*(one(i, n) for i, n in enumerate(keys)))
        stuck = [n.hash for n in keys if await state(store, n) == (True, False, False)]
        assert stuck == []
        for n in keys:
            assert await store.claim_unless_done(n.claim, n.result, b"later", 30) is not None
    finally:
        await store.aclose()
        await runner.aclose()


async def test_a_key_in_flight_is_refused_with_its_lease_left(store: Store) -> None:
    n = names("in-flight")
    assert await store.claim_unless_done(n.claim, n.result, b"run-1", 30) is CLAIMED
    with pytest.raises(InFlightError, match="in flight") as caught:
        await forget(store, names=n)
    assert 0 < caught.value.retry_after <= 30
    assert await store.get(n.claim) == b"run-1"


async def test_a_cluster_forgets_in_one_step_on_the_keys_primary(native_module: Any) -> None:
    for mode, modules in (("script", []), ("native", [str(native_module)])):
        cluster = start_cluster("redis", masters=3, modules=modules)
        try:
            store = RedisStore.from_url(cluster.servers[0].url, cluster=True, mode=mode)  # type: ignore[arg-type]
            try:
                for i in range(6):  # over several slots, so over every primary
                    n = names(f"cluster-{mode}-{i}")
                    await run_to_completion(store, n)
                    assert await forget(store, names=n) is True
                    assert await state(store, n) == (False, False, False)
                n = names(f"cluster-{mode}-running")
                assert await store.claim_unless_done(n.claim, n.result, b"r", 30) is CLAIMED
                with pytest.raises(InFlightError):
                    await forget(store, names=n)
                assert await store.get(n.claim) == b"r"
            finally:
                await store.aclose()
        finally:
            cluster.stop()


def forget_command(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GOBLIN_SCOPE", "DATABASE_URL")}
    return subprocess.run(
        [sys.executable, "-m", "goblin_idem", "forget", *args],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


async def test_the_forget_command_forgets_the_store_alone_only_when_told(
    redis_server: Server,
) -> None:
    store = RedisStore.from_url(redis_server.url)
    n = names("cli")
    try:
        await run_to_completion(store, n)
        refused = await asyncio.to_thread(forget_command, "--url", redis_server.url, "cli")
        assert refused.returncode == 2 and "--store-only" in refused.stderr
        assert await state(store, n) == (True, True, False)
        both = ("--url", redis_server.url, "--store-only", "--database-url", "sqlite://", "cli")
        assert (await asyncio.to_thread(forget_command, *both)).returncode == 2
        done = await asyncio.to_thread(
            forget_command, "--url", redis_server.url, "--store-only", "cli"
        )
        assert done.returncode == 0 and done.stdout.strip() == "forgotten", done.stderr
        assert await state(store, n) == (False, False, False)
        await store.claim_unless_done(n.claim, n.result, b"run-2", 30)
        running = await asyncio.to_thread(
            forget_command, "--url", redis_server.url, "--store-only", "cli"
        )
        assert running.returncode == 1 and "in flight" in running.stderr
        assert await store.get(n.claim) == b"run-2"
    finally:
        await store.aclose()


async def test_forget_stops_every_store_of_this_process_replaying_from_memory_at_once(
    redis_server: Server,
) -> None:
    """Another store of this process keeps the key in its replay cache, on a connection
    whose invalidations are held up (a stalled proxy): once forget has returned, that store
    no longer answers the key from memory, whatever its connection has yet to read."""
    with Proxy(redis_server.port) as proxy:
        cached = RedisStore.from_url(proxy.url, replay_cache_bytes=BUDGET)
        store = RedisStore.from_url(redis_server.url)
        n = names(f"cached-{secrets.token_hex(4)}")
        try:
            await run_to_completion(cached, n)
            # its first duplicate reads the store, and keeps the result in memory
            assert await cached.claim_unless_done(n.claim, n.result, b"run-2", 30) == b"GI-answer"
            replays = cached._executor.replays
            assert replays is not None
            await until(lambda: replays.cached(n.result) == b"GI-answer")
            assert proxy.stall(30) >= 1  # nothing reaches `cached` any more
            assert await forget(store, names=n) is True
            assert replays.cached(n.result) is None
        finally:
            await store.aclose()
            proxy.reset()
            await cached.aclose()
