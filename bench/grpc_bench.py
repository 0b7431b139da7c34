"""AsyncIdempotencyInterceptor against the bare gRPC server, in one run, as ratios.

    python bench/grpc_bench.py [--calls 4000] [--reps 5] [--concurrency 16] [--work-ms 1]

Two grpc.aio servers in this process on free loopback ports, serving the tests' Payments
service (tests/support/protos/payments.proto): one bare, one with the interceptor over a
throwaway redis-server. The handler answers after `--work-ms` of awaited work (a database
write's round trip; 0 for none). Per repetition, each variant in turn (each repetition
starting at the next one, so that drift hits each alike), `--calls` unary calls from
`--concurrency` callers on one channel; the figure is calls per second, and the ratio is
the variant's over the bare server's in the same repetition (medians of `--reps`):

- ``new``: a fresh request_id per call (claimed, run, published);
- ``replay``: one of 100 request_ids answered before (from the store, without running);
- ``no key``: an empty request_id and no metadata (passed through to the handler).

Targets: new >= 0.6x, replay >= 1.5x (a handler with work to skip), no key >= 0.97x.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))  # for tests.support

import grpc

from goblin_idem import RedisStore
from goblin_idem.grpc import AsyncIdempotencyInterceptor
from tests.support.rpc import payments
from tests.support.servers import start_server

pb2, pb2_grpc = payments()
VARIANTS = ("bare", "new", "replay", "no key")
TARGETS = {"new": 0.6, "replay": 1.5, "no key": 0.97}


class Work(pb2_grpc.PaymentsServicer):  # type: ignore[misc,name-defined]
    def __init__(self, work_seconds: float) -> None:
        self.work = work_seconds

    async def Charge(self, request: Any, context: Any) -> Any:
        if self.work:
            await asyncio.sleep(self.work)
        return pb2.ChargeReply(charge_id="ch_1", amount=request.amount)


async def serve(interceptors: list[Any], work: float) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=interceptors)
    pb2_grpc.add_PaymentsServicer_to_server(Work(work), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def drive(stub: Any, requests: list[Any], concurrency: int) -> float:
    """Calls per second for `requests`, sent by `concurrency` callers."""
    it = iter(requests)

    async def caller() -> None:
        for request in it:
            await stub.Charge(request)

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return len(requests) / (time.perf_counter() - start)


async def main(args: argparse.Namespace) -> int:
    redis = start_server("redis")
    store = RedisStore.from_url(redis.url)
    servers: list[grpc.aio.Server] = []
    try:
        bare, bare_port = await serve([], args.work_ms / 1000)
        keyed, keyed_port = await serve([AsyncIdempotencyInterceptor(store)], args.work_ms / 1000)
        servers += [bare, keyed]
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{bare_port}") as to_bare,
            grpc.aio.insecure_channel(f"127.0.0.1:{keyed_port}") as to_keyed,
        ):
            stubs = {"bare": pb2_grpc.PaymentsStub(to_bare)}
            stubs.update(dict.fromkeys(VARIANTS[1:], pb2_grpc.PaymentsStub(to_keyed)))
            done = [pb2.ChargeRequest(request_id=f"done-{i}", amount=5) for i in range(100)]
            for request in done:
                await stubs["new"].Charge(request)
            fresh = itertools.count()
            rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
            ratios: dict[str, list[float]] = {v: [] for v in VARIANTS[1:]}
            for rep in range(args.reps):
                order = VARIANTS[rep % 4 :] + VARIANTS[: rep % 4]
                measured = {}
                for variant in order:
                    if variant == "new":
                        requests = [
                            pb2.ChargeRequest(request_id=f"new-{next(fresh)}", amount=5)
                            for _ in range(args.calls)
                        ]
                    elif variant == "replay":
                        requests = [done[i % 100] for i in range(args.calls)]
                    else:
                        requests = [pb2.ChargeRequest(amount=5)] * args.calls
                    await drive(stubs[variant], requests[:200], args.concurrency)  # warm
                    measured[variant] = await drive(stubs[variant], requests, args.concurrency)
                for variant, rate in measured.items():
                    rates[variant].append(rate)
                    if variant != "bare":
                        ratios[variant].append(rate / measured["bare"])
    finally:
        for server in servers:
            await server.stop(None)
        await store.aclose()
        redis.stop()
    print(
        f"{args.calls} calls x {args.reps} reps, {args.concurrency} callers, handler work "
        f"{args.work_ms:g} ms; medians"
    )
    failed = False
    for variant in VARIANTS:
        line = f"{variant:>8}: {statistics.median(rates[variant]):8.0f} calls/s"
        if variant != "bare":
            ratio = statistics.median(ratios[variant])
            ok = ratio >= TARGETS[variant]
            failed |= not ok
            line += f"  {ratio:.2f}x bare (target {TARGETS[variant]}x{'' if ok else ', MISSED'})"
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--work-ms", type=float, default=1.0)
    sys.exit(asyncio.run(main(parser.parse_args())))
