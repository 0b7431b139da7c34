"""IdempotencyInterceptor on a real sync grpc.server (a thread pool): the handler in the
server's worker thread, the claim, lease and publish on the loop thread; the embedded
store, redis-server (scripts) and valkey-server (the module)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from goblin_idem import RedisStore, Store
from goblin_idem._threads._loop import loop_thread
from goblin_idem.grpc import IdempotencyInterceptor
from tests.grpc.conftest import CHARGE, pb2, pb2_grpc
from tests.support.backends import sync_store  # noqa: F401
from tests.support.servers import free_port


class SyncPayments(pb2_grpc.PaymentsServicer):  # type: ignore[misc,name-defined]
    """The sync twin of conftest.Payments (the same accounts)."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        self.keys: list[str] = []
        self.gate = threading.Event()
        self.started = threading.Event()
        self.finished = threading.Event()
        self.ended = threading.Event()

    def Charge(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.runs[request.account] += 1
        self.keys.append(request.request_id)
        action, _, code = request.account.partition(":")
        if action == "flaky" and self.runs[request.account] == 1:
            context.abort(grpc.StatusCode.UNAVAILABLE, "a blip")
        if action == "abort":
            context.set_trailing_metadata((("reason", "test"),))
            context.abort(grpc.StatusCode[code], f"refused {request.amount}")
        if action == "raise":
            raise RuntimeError("the handler failed")
        if action == "gate":
            context.add_callback(self.ended.set)  # the server saw the call end
            self.started.set()
            self.gate.wait(30)
            self.finished.set()
        context.set_trailing_metadata((("charged-by", "payments"),))
        n = sum(self.runs.values())
        return pb2.ChargeReply(charge_id=f"ch_{n}", amount=request.amount)

    def Split(self, request: Any, context: Any) -> Any:
        self.runs["split"] += 1
        for i in range(3):
            yield pb2.ChargeReply(charge_id=f"part_{self.runs['split']}_{i}", amount=i)

    def Batch(self, request_iterator: Any, context: Any) -> Any:
        self.runs["batch"] += 1
        total = sum(item.amount for item in request_iterator)
        return pb2.ChargeReply(charge_id=f"batch_{self.runs['batch']}", amount=total)


@contextlib.contextmanager
def serving(
    interceptor: IdempotencyInterceptor, service: Any = None
) -> Iterator[tuple[Any, grpc.Channel]]:
    """A sync server on a free loopback port (`service`, or a `SyncPayments`), a channel to it."""
    service = service or SyncPayments()
    server = grpc.server(ThreadPoolExecutor(max_workers=24), interceptors=[interceptor])
    pb2_grpc.add_PaymentsServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield service, channel
    finally:
        channel.close()
        server.stop(None).wait()


def call(
    channel: grpc.Channel, request: Any, timeout: float | None = None
) -> tuple[grpc.StatusCode, str, dict[str, Any], bytes | None]:
    stub = channel.unary_unary(CHARGE, request_serializer=lambda m: m.SerializeToString())
    try:
        body, c = stub.with_call(request, timeout=timeout)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", dict(exc.trailing_metadata() or ()), None  # type: ignore[attr-defined]
    return c.code(), c.details() or "", dict(c.trailing_metadata() or ()), body


def charge(account: str = "acct", amount: int = 500) -> Any:
    """A request keyed by its account: one key per scenario."""
    return pb2.ChargeRequest(request_id=f"req-{account}", account=account, amount=amount)


def until(condition: Any, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true in time"
        time.sleep(0.01)


def test_a_duplicate_gets_the_first_response(store: Store) -> None:
    interceptor = IdempotencyInterceptor(store)
    with serving(interceptor) as (service, channel):
        first = call(channel, charge())
        again = call(channel, charge())
        other = call(channel, charge(amount=7))
    assert first[0] == again[0] == grpc.StatusCode.OK and again[3] == first[3]
    assert again[2]["idempotent-replayed"] == "true" and again[2]["charged-by"] == "payments"
    assert other[0] == grpc.StatusCode.FAILED_PRECONDITION and "key reused" in other[1]
    assert service.runs["acct"] == 1


def test_concurrent_duplicates_in_threads_run_once(store: Store) -> None:
    interceptor = IdempotencyInterceptor(store)
    with serving(interceptor) as (service, channel):
        with ThreadPoolExecutor(20) as pool:
            results = list(pool.map(lambda _: call(channel, charge()), range(20)))
        after = call(channel, charge())
    assert service.runs["acct"] == 1
    assert {r[3] for r in results if r[0] == grpc.StatusCode.OK} == {after[3]}


def test_in_flight_is_aborted_and_kept_errors_replay(store: Store) -> None:
    interceptor = IdempotencyInterceptor(store)
    with serving(interceptor) as (service, channel):
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(call, channel, charge("gate"))
            assert service.started.wait(10)
            status, _, trailing, _ = call(channel, charge("gate"))
            service.gate.set()
            assert first.result()[0] == grpc.StatusCode.OK
        found = [call(channel, charge("abort:NOT_FOUND")) for _ in range(2)]
        down = [call(channel, charge("abort:UNAVAILABLE")) for _ in range(2)]
        raised = [call(channel, charge("raise"))[0] for _ in range(2)]
    assert status == grpc.StatusCode.ABORTED and trailing["retry-after"] == "1"
    assert found[0][:2] == found[1][:2] == (grpc.StatusCode.NOT_FOUND, "refused 500")
    assert found[1][2]["reason"] == "test" and found[1][2]["idempotent-replayed"] == "true"
    assert service.runs["abort:NOT_FOUND"] == 1
    assert [d[0] for d in down] == [grpc.StatusCode.UNAVAILABLE] * 2
    assert service.runs["abort:UNAVAILABLE"] == 2
    assert raised == [grpc.StatusCode.UNKNOWN] * 2 and service.runs["raise"] == 2


def test_a_deadline_that_passes_while_the_handler_runs_keeps_nothing(store: Store) -> None:
    interceptor = IdempotencyInterceptor(store)
    with serving(interceptor) as (service, channel):
        status, *_ = call(channel, charge("gate"), timeout=0.5)
        assert status == grpc.StatusCode.DEADLINE_EXCEEDED
        assert service.ended.wait(10)
        service.gate.set()  # the handler returns after its client has gone
        assert service.finished.wait(10)
        until(lambda: interceptor.counters.released == 1)
        retry = call(channel, charge("gate"))
    assert retry[0] == grpc.StatusCode.OK and "idempotent-replayed" not in retry[2]
    assert service.runs["gate"] == 2


def test_streams_are_kept_and_replayed(store: Store) -> None:
    interceptor = IdempotencyInterceptor(store)
    with serving(interceptor) as (service, channel):
        split = channel.unary_stream(
            "/payments.Payments/Split", request_serializer=lambda m: m.SerializeToString()
        )
        batch = channel.stream_unary(
            "/payments.Payments/Batch", request_serializer=lambda m: m.SerializeToString()
        )
        request = pb2.ChargeRequest(request_id="s-1")
        streams = [list(split(request)) for _ in range(2)]
        items = [pb2.Item(request_id="b-1", amount=2), pb2.Item(amount=3)]
        sums = [batch(iter(items)) for _ in range(2)]
    assert len(streams[0]) == 3 and streams[1] == streams[0]
    assert sums[1] == sums[0] and pb2.ChargeReply.FromString(sums[0]).amount == 5
    assert service.runs["split"] == service.runs["batch"] == 1


def test_a_store_that_is_down_is_unavailable_and_runs_nothing() -> None:
    store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0")
    interceptor = IdempotencyInterceptor(store)
    try:
        with serving(interceptor) as (service, channel):
            status, details, *_ = call(channel, charge())
    finally:
        loop_thread().run(store.aclose())
    assert status == grpc.StatusCode.UNAVAILABLE and "store is unavailable" in details
    assert service.runs["acct"] == 0
