"""A server process SIGKILLed while its handler runs: the key stays claimed until the
lease runs out (duplicates are told the first call is still running), then the retry runs
the handler; the client interceptor rides it out with the same key."""

from __future__ import annotations

import asyncio
import signal

import grpc

from goblin_idem import RedisStore
from goblin_idem.grpc import (
    AsyncIdempotencyInterceptor,
    AsyncIdempotentClientInterceptor,
    RetryPolicy,
)
from tests.grpc.conftest import pb2, pb2_grpc, serving, targets
from tests.support.procs import spawn, stop
from tests.support.servers import Server, free_port


async def claimed(store: RedisStore, call: asyncio.Future[object], seconds: float = 10) -> None:
    """Wait until the call's key is claimed in the store (its handler is running)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not await store.client.keys(b"grpc:*:c"):  # type: ignore[union-attr]
        assert not call.done() and loop.time() < deadline, "the call never claimed its key"
        await asyncio.sleep(0.01)


async def test_a_retry_after_the_server_was_killed_runs_once_the_lease_ran_out(
    own_redis: Server,
) -> None:
    port = free_port()
    proc = spawn(
        ["-m", "tests.support.apps.grpc_app"],
        {"REDIS_URL": own_redis.url, "LEASE_SECONDS": "1", "GRPC_PORT": str(port)},
    )
    store = RedisStore.from_url(own_redis.url)
    request = pb2.ChargeRequest(request_id="crash-1", account="hang", amount=9)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await asyncio.wait_for(channel.channel_ready(), 30)
            hung = asyncio.ensure_future(pb2_grpc.PaymentsStub(channel).Charge(request))
            await claimed(store, hung)
            stop(proc, signal.SIGKILL)
            try:
                await hung
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
        interceptor = AsyncIdempotencyInterceptor(store, lease_seconds=1)
        async with serving([interceptor]) as (service, channel):
            retrying = AsyncIdempotentClientInterceptor(policy=RetryPolicy(max_attempts=10))
            async with grpc.aio.insecure_channel(
                targets[channel], interceptors=[retrying]
            ) as client:
                reply = await pb2_grpc.PaymentsStub(client).Charge(request)
        assert reply.amount == 9 and service.runs["hang"] == 1
        assert service.keys == ["crash-1"]
    finally:
        stop(proc, signal.SIGKILL)
        await store.aclose()
