"""The records project serving gRPC: a sync ``grpc.server`` with IdempotencyInterceptor and
``DjangoRecords()``, whose ``Charge`` writes a payment through the ORM (account ``fail``:
UNAVAILABLE after the write, ``missing``: NOT_FOUND after it). Configured as the project
(``DJANGO_DB``, ``REDIS_URL``), and ``GRPC_PORT``; for tests/grpc/test_django.py.

    python -m tests.support.apps.django_records.grpc_server
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import django
import grpc

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.support.apps.django_records.settings")
django.setup()

from goblin_idem import RedisStore  # noqa: E402
from goblin_idem.django import DjangoRecords  # noqa: E402
from goblin_idem.grpc import IdempotencyInterceptor  # noqa: E402
from tests.support.rpc import payments  # noqa: E402

from .models import Payment  # noqa: E402

pb2, pb2_grpc = payments()


class Payments(pb2_grpc.PaymentsServicer):  # type: ignore[misc,name-defined]
    def Charge(self, request: Any, context: grpc.ServicerContext) -> Any:
        payment = Payment.objects.create(ref=request.request_id, amount=request.amount)
        if request.account == "fail":
            context.abort(grpc.StatusCode.UNAVAILABLE, "failed after the write")
        if request.account == "missing":
            context.abort(grpc.StatusCode.NOT_FOUND, "no such account")
        return pb2.ChargeReply(charge_id=f"ch_{payment.id}", amount=request.amount)


def main() -> None:
    store = RedisStore.from_url(os.environ["REDIS_URL"])
    interceptor = IdempotencyInterceptor(store, records=DjangoRecords())
    server = grpc.server(ThreadPoolExecutor(max_workers=8), interceptors=[interceptor])
    pb2_grpc.add_PaymentsServicer_to_server(Payments(), server)
    server.add_insecure_port(f"127.0.0.1:{os.environ['GRPC_PORT']}")
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    main()
