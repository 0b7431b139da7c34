"""The client interceptors against a real server with AsyncIdempotencyInterceptor: a key
filled in and kept across retries, in-flight ABORTED waited out, and keys derived inside a
claimed run, so that a re-run of one service charges the next one once."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from goblin_idem import MemoryStore, RedisStore
from goblin_idem.grpc import (
    AsyncIdempotencyInterceptor,
    AsyncIdempotentClientInterceptor,
    IdempotencyInterceptor,
    IdempotentClientInterceptor,
    RetryPolicy,
)
from tests.grpc.conftest import pb2, pb2_grpc, raw, serving, targets, until
from tests.grpc.test_sync import serving as sync_serving

FAST = RetryPolicy(max_attempts=5, base_delay=0.01, max_delay=0.05)


@contextlib.asynccontextmanager
async def client(channel: grpc.aio.Channel, **options: Any) -> AsyncIterator[Any]:
    """A stub on a new channel to `channel`'s server, through the async client interceptor."""
    target = targets[channel]
    interceptor = AsyncIdempotentClientInterceptor(**options)
    async with grpc.aio.insecure_channel(target, interceptors=[interceptor]) as keyed:
        yield pb2_grpc.PaymentsStub(keyed)


async def test_an_empty_request_id_is_filled_and_kept_across_a_retry(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    async with serving([interceptor]) as (service, channel), client(channel, policy=FAST) as stub:
        request = pb2.ChargeRequest(account="flaky", amount=5)
        reply = await stub.Charge(request)
        other = await stub.Charge(request)
    assert reply.amount == 5 and request.request_id == ""  # the caller's message untouched
    first, retried, third = service.keys
    assert first == retried and uuid.UUID(first).version == 4
    assert third != first and other.charge_id != reply.charge_id


async def test_a_request_without_the_field_gets_the_key_in_metadata(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    async with serving([interceptor]) as (service, channel), client(channel) as stub:
        await stub.Echo(pb2.Ping(text="hi"))
        sent = await stub.Echo(pb2.Ping(text="hi"), metadata=(("idempotency-key", "mine"),))
        again = await stub.Echo(pb2.Ping(text="hi"), metadata=(("idempotency-key", "mine"),))
    assert uuid.UUID(service.keys[0]).version == 4 and service.keys[1:] == ["mine"]
    assert again == sent


async def test_an_in_flight_duplicate_is_retried_after_retry_after(store: RedisStore) -> None:
    interceptor = AsyncIdempotencyInterceptor(store, retry_after_seconds=1)
    request = pb2.ChargeRequest(request_id="held", account="gate")
    async with serving([interceptor]) as (service, channel), client(channel) as stub:
        first = asyncio.ensure_future(raw(channel)(request))
        await service.started.wait()
        second = asyncio.ensure_future(stub.Charge(request))
        await until(lambda: interceptor.counters.in_flight >= 1)
        service.gate.set()
        body, reply = await first, await second
    assert reply == pb2.ChargeReply.FromString(body) and service.runs["gate"] == 1


@pytest.mark.parametrize("account", ["abort:NOT_FOUND", "abort:INTERNAL", "raise"])
async def test_other_statuses_are_not_retried(
    interceptor: AsyncIdempotencyInterceptor, account: str
) -> None:
    async with serving([interceptor]) as (service, channel), client(channel, policy=FAST) as stub:
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Charge(pb2.ChargeRequest(account=account))
    assert service.runs[account] == 1


async def test_max_attempts_bounds_the_retries(interceptor: AsyncIdempotencyInterceptor) -> None:
    policy = RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.01)
    async with serving([interceptor]) as (service, channel), client(channel, policy=policy) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stub.Charge(pb2.ChargeRequest(account="abort:UNAVAILABLE"))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert service.runs["abort:UNAVAILABLE"] == 3 and len(set(service.keys)) == 1


class Front(pb2_grpc.PaymentsServicer):  # type: ignore[misc,name-defined]
    """Service A: charges through service B, then fails once after B answered."""

    def __init__(self, b: Any) -> None:
        self.b = b
        self.runs = 0
        self.b_keys: list[str] = []

    async def Charge(self, request: Any, context: Any) -> Any:
        self.runs += 1
        reply = await self.b.Charge(
            pb2.ChargeRequest(account="acct", amount=request.amount),
            metadata=[("idempotency-label", "charge")],
        )
        if self.runs == 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "failed after B answered")
        return reply


async def test_a_derived_key_makes_a_rerun_charge_the_next_service_once(
    store: RedisStore,
) -> None:
    """The client retries A (UNAVAILABLE after its call to B); A's second run calls B with
    the key derived from A's claim, the same as the first run's: B replays, B ran once."""
    async with serving([AsyncIdempotencyInterceptor(store)]) as (b_service, b_channel):
        async with client(b_channel) as b:
            front = Front(b)
            a_interceptor = AsyncIdempotencyInterceptor(store)
            async with serving([a_interceptor], front) as (_, a_channel):  # type: ignore[arg-type]
                async with client(a_channel, policy=FAST) as a:
                    reply = await a.Charge(pb2.ChargeRequest(amount=42))
    assert reply.amount == 42 and front.runs == 2
    assert b_service.runs["acct"] == 1
    assert len(b_service.keys) == 1 and uuid.UUID(b_service.keys[0]).version == 8


async def test_derived_keys_off_draws_a_new_key_per_run(store: RedisStore) -> None:
    async with serving([AsyncIdempotencyInterceptor(store)]) as (b_service, b_channel):
        async with client(b_channel, derived_keys=False) as b:
            front = Front(b)
            async with serving([AsyncIdempotencyInterceptor(store)], front) as (_, a_channel):  # type: ignore[arg-type]
                async with client(a_channel, policy=FAST) as a:
                    await a.Charge(pb2.ChargeRequest(amount=42))
    assert b_service.runs["acct"] == 2  # what derived keys prevent


class TwoCalls(pb2_grpc.PaymentsServicer):  # type: ignore[misc,name-defined]
    """A's handler calling B's one method twice, for two things: each call labelled, or
    (`labels` None) neither."""

    def __init__(self, b: Any, labels: tuple[str, str] | None) -> None:
        self.b = b
        self.labels = labels
        self.refused: list[str] = []

    async def Charge(self, request: Any, context: Any) -> Any:
        replies = []
        for i, account in enumerate(("fees", "acct")):
            metadata = () if self.labels is None else (("idempotency-label", self.labels[i]),)
            try:
                replies.append(
                    await self.b.Charge(
                        pb2.ChargeRequest(account=account, amount=request.amount),
                        metadata=metadata,
                    )
                )
            except TypeError as exc:
                self.refused.append(str(exc))
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "unlabelled")
        return replies[-1]


async def test_two_calls_of_one_method_in_a_run_keep_their_own_keys(store: RedisStore) -> None:
    """A key by the method alone gave the second call the first one's key: B answered it
    with the first call's charge (or key reuse). Labelled, each call is its own."""
    async with serving([AsyncIdempotencyInterceptor(store)]) as (b_service, b_channel):
        async with client(b_channel) as b:
            front = TwoCalls(b, ("fee", "order"))
            async with serving([AsyncIdempotencyInterceptor(store)], front) as (_, a_channel):  # type: ignore[arg-type]
                async with client(a_channel, policy=FAST) as a:
                    reply = await a.Charge(pb2.ChargeRequest(amount=7))
    assert reply.amount == 7 and reply.charge_id
    assert b_service.runs == {"fees": 1, "acct": 1}
    assert len(set(b_service.keys)) == 2


async def test_an_unlabelled_call_in_a_run_is_refused_before_it_is_sent(
    store: RedisStore,
) -> None:
    async with serving([AsyncIdempotencyInterceptor(store)]) as (b_service, b_channel):
        async with client(b_channel) as b:
            front = TwoCalls(b, None)
            async with serving([AsyncIdempotencyInterceptor(store)], front) as (_, a_channel):  # type: ignore[arg-type]
                async with client(a_channel, policy=FAST) as a:
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await a.Charge(pb2.ChargeRequest(amount=7))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "idempotency-label" in front.refused[0]
    assert b_service.keys == []  # nothing reached B


def test_the_sync_client_keys_and_retries() -> None:
    with sync_serving(IdempotencyInterceptor(MemoryStore())) as (service, channel):
        keyed = grpc.intercept_channel(channel, IdempotentClientInterceptor(policy=FAST))
        stub = pb2_grpc.PaymentsStub(keyed)
        reply = stub.Charge(pb2.ChargeRequest(account="flaky", amount=3))
        batch = stub.Batch(iter([pb2.Item(amount=1), pb2.Item(amount=2)]))
    assert reply.amount == 3 and service.runs["flaky"] == 2
    assert service.keys[0] == service.keys[1] and uuid.UUID(service.keys[0]).version == 4
    assert batch.amount == 3


def test_a_wrong_policy_is_refused() -> None:
    with pytest.raises(TypeError):
        AsyncIdempotentClientInterceptor(policy={"max_attempts": 3})  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        IdempotentClientInterceptor(policy=RetryPolicy(max_attempts=0))
