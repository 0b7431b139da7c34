"""The gRPC tests' parts: a store on a real redis-server or valkey-server, the test service
(compiled from tests/support/protos/payments.proto), and grpc.aio servers on free loopback
ports with an interceptor in front."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from goblin_idem import RedisStore
from goblin_idem.grpc import AsyncIdempotencyInterceptor
from tests.support.backends import server_for
from tests.support.rpc import payments

pb2, pb2_grpc = payments()
CHARGE = "/payments.Payments/Charge"


@pytest.fixture(params=["redis-script", "valkey-native"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[RedisStore]:
    server = server_for(request, request.param)
    store = RedisStore.from_url(server.url, mode=request.param.split("-")[1])  # type: ignore[arg-type]
    await store.client.flushall()
    yield store
    await store.aclose()


class Payments(pb2_grpc.PaymentsServicer):  # type: ignore[misc,name-defined]
    """The test service. What `Charge` does is named by the request's account:

    - ``abort:<CODE>``: context.abort with that status, details and a trailer;
    - ``code:<CODE>``: set_code / set_details, then return;
    - ``flaky``: UNAVAILABLE at its first run;
    - ``raise``: a RuntimeError; ``big``: a reply of 4 KiB;
    - ``gate``: wait for `gate` (a duplicate meanwhile is in flight); a cancellation is
      recorded in `cancelled`;
    - anything else: a reply whose charge id counts the runs (a re-run answers otherwise).
    """

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        self.keys: list[str] = []  # the request id (or idempotency-key) of every run
        self.gate = asyncio.Event()
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def Charge(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        self.runs[request.account] += 1
        self.keys.append(request.request_id)
        n = sum(self.runs.values())
        action, _, code = request.account.partition(":")
        if action == "flaky" and self.runs[request.account] == 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "a blip")
        if action == "abort":
            await context.abort(
                grpc.StatusCode[code], f"refused {request.amount}", (("reason", "test"),)
            )
        if action == "code":
            context.set_code(grpc.StatusCode[code])
            context.set_details(f"set {request.amount}")
            return pb2.ChargeReply()
        if action == "raise":
            raise RuntimeError("the handler failed")
        if action == "gate":
            self.started.set()
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        context.set_trailing_metadata((("charged-by", "payments"),))
        charge_id = "x" * 4096 if action == "big" else f"ch_{n}"
        return pb2.ChargeReply(charge_id=charge_id, amount=request.amount, tags=request.tags)

    async def Echo(self, request: Any, context: Any) -> Any:
        self.runs["echo"] += 1
        self.keys.append(dict(context.invocation_metadata() or ()).get("idempotency-key", ""))
        return pb2.Ping(text=f"{request.text} {self.runs['echo']}")

    async def Split(self, request: Any, context: Any) -> Any:
        self.runs["split"] += 1
        if request.account.startswith("abort:"):
            yield pb2.ChargeReply(charge_id="part", amount=1)
            await context.abort(grpc.StatusCode[request.account[6:]], "split refused")
        for i in range(3):
            yield pb2.ChargeReply(charge_id=f"part_{self.runs['split']}_{i}", amount=i)

    async def Batch(self, request_iterator: Any, context: Any) -> Any:
        self.runs["batch"] += 1
        total = 0
        async for item in request_iterator:
            total += item.amount
        return pb2.ChargeReply(charge_id=f"batch_{self.runs['batch']}", amount=total)

    async def Chat(self, request_iterator: Any, context: Any) -> Any:
        self.runs["chat"] += 1
        async for item in request_iterator:
            yield item


targets: weakref.WeakKeyDictionary[grpc.aio.Channel, str] = weakref.WeakKeyDictionary()


@contextlib.asynccontextmanager
async def serving(
    interceptors: list[Any], servicer: Payments | None = None
) -> AsyncIterator[tuple[Payments, grpc.aio.Channel]]:
    """A grpc.aio server on a free loopback port with `interceptors`, and a channel to it."""
    service = servicer or Payments()
    server = grpc.aio.server(interceptors=interceptors)
    pb2_grpc.add_PaymentsServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    targets[channel] = f"127.0.0.1:{port}"
    try:
        yield service, channel
    finally:
        await channel.close()
        await server.stop(None)


def raw(channel: grpc.aio.Channel, method: str = CHARGE) -> Callable[..., Any]:
    """A unary call that returns the response's bytes as they came."""
    return channel.unary_unary(method, request_serializer=lambda m: m.SerializeToString())


async def until(condition: Callable[[], bool], seconds: float = 10) -> None:
    """Wait for `condition`, polling, up to `seconds` (an AssertionError past them)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not condition():
        assert loop.time() < deadline, "the condition did not come true in time"
        await asyncio.sleep(0.01)


@pytest.fixture
def interceptor(store: RedisStore) -> AsyncIdempotencyInterceptor:
    return AsyncIdempotencyInterceptor(store)
