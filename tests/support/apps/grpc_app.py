"""A grpc.aio server with AsyncIdempotencyInterceptor in a process of its own, for tests
that stop it by signal mid-call. ``Charge`` with account ``hang`` never answers; any other
answers at once. Configured by environment: REDIS_URL, LEASE_SECONDS, GRPC_PORT.

    python -m tests.support.apps.grpc_app
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import grpc

from goblin_idem import RedisStore
from goblin_idem.grpc import AsyncIdempotencyInterceptor
from tests.support.rpc import payments

pb2, pb2_grpc = payments()


class Hanging(pb2_grpc.PaymentsServicer):  # type: ignore[misc,name-defined]
    async def Charge(self, request: Any, context: Any) -> Any:
        if request.account == "hang":
            await asyncio.Event().wait()
        return pb2.ChargeReply(charge_id=f"ch_{os.getpid()}", amount=request.amount)


async def main() -> None:
    store = RedisStore.from_url(os.environ["REDIS_URL"])
    interceptor = AsyncIdempotencyInterceptor(
        store, lease_seconds=float(os.environ.get("LEASE_SECONDS", "30"))
    )
    server = grpc.aio.server(interceptors=[interceptor])
    pb2_grpc.add_PaymentsServicer_to_server(Hanging(), server)
    server.add_insecure_port(f"127.0.0.1:{os.environ['GRPC_PORT']}")
    await server.start()
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main())
