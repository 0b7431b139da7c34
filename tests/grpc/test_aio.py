"""AsyncIdempotencyInterceptor on a real grpc.aio server, over real redis-server and
valkey-server: AIP-155's request_id, replay byte for byte, in flight, key reuse, the
statuses kept and not, a store that is down, a client that goes away."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import pytest

from goblin_idem import RedisStore
from goblin_idem.grpc import AsyncIdempotencyInterceptor
from tests.grpc.conftest import CHARGE, pb2, raw, serving, until
from tests.support.servers import free_port

Metadata = tuple[tuple[str, Any], ...]


def charge(key: str = "req-1", account: str = "acct", amount: int = 500, **kw: Any) -> Any:
    return pb2.ChargeRequest(request_id=key, account=account, amount=amount, **kw)


async def call(
    channel: grpc.aio.Channel, request: Any, metadata: Metadata = (), method: str = CHARGE
) -> tuple[grpc.StatusCode, str, dict[str, Any], bytes | None]:
    """The call's status, details, trailing metadata and response bytes."""
    c = raw(channel, method)(request, metadata=metadata)
    try:
        body = await c
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or "", dict(exc.trailing_metadata() or ()), None
    return await c.code(), await c.details() or "", dict(await c.trailing_metadata()), body


async def test_a_duplicate_gets_the_first_response_byte_for_byte(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    async with serving([interceptor]) as (service, channel):
        request = charge(tags={"b": "2", "a": "1", "c": "3"})
        first = await call(channel, request)
        again = await call(channel, request)
    assert first[0] == grpc.StatusCode.OK and service.runs["acct"] == 1
    assert again[0] == grpc.StatusCode.OK
    assert again[3] == first[3]  # the first call's bytes, not a second run's "ch_2"
    assert pb2.ChargeReply.FromString(again[3]).charge_id == "ch_1"
    assert first[2]["charged-by"] == "payments" and "idempotent-replayed" not in first[2]
    assert again[2]["charged-by"] == "payments" and again[2]["idempotent-replayed"] == "true"
    assert interceptor.counters.claimed == 1 and interceptor.counters.replayed == 1


async def test_the_key_comes_from_metadata_when_the_request_has_no_field(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    echo = "/payments.Payments/Echo"
    async with serving([interceptor]) as (_service, channel):
        keyed = (("idempotency-key", "ping-1"),)
        first = await call(channel, pb2.Ping(text="hi"), keyed, echo)
        again = await call(channel, pb2.Ping(text="hi"), keyed, echo)
        bare = [await call(channel, pb2.Ping(text="hi"), (), echo) for _ in range(2)]
    assert first[3] == again[3] and again[2]["idempotent-replayed"] == "true"
    assert [pb2.Ping.FromString(b[3]).text for b in bare] == ["hi 2", "hi 3"]
    assert all("idempotent-replayed" not in b[2] for b in bare)


async def test_an_empty_request_id_without_metadata_passes_through(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    async with serving([interceptor]) as (service, channel):
        for _ in range(2):
            status, *_ = await call(channel, charge(key=""))
            assert status == grpc.StatusCode.OK
    assert service.runs["acct"] == 2 and interceptor.counters.claimed == 0


async def test_the_request_field_wins_over_the_metadata(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    async with serving([interceptor]) as (service, channel):
        await call(channel, charge(key="field"), (("idempotency-key", "a"),))
        again = await call(channel, charge(key="field"), (("idempotency-key", "b"),))
    assert service.runs["acct"] == 1 and again[2]["idempotent-replayed"] == "true"


@pytest.mark.parametrize("key", ["x" * 256, "caf\u00e9", "tab\there"])
async def test_a_malformed_key_is_invalid_argument_and_runs_nothing(
    interceptor: AsyncIdempotencyInterceptor, key: str
) -> None:
    async with serving([interceptor]) as (service, channel):
        status, details, *_ = await call(channel, charge(key=key))
    assert status == grpc.StatusCode.INVALID_ARGUMENT and "not a valid idempotency key" in details
    assert service.runs["acct"] == 0 and interceptor.counters.invalid_key == 1


async def test_another_request_under_the_same_key_is_failed_precondition(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    async with serving([interceptor]) as (service, channel):
        await call(channel, charge(amount=500))
        status, details, *_ = await call(channel, charge(amount=999))
    assert status == grpc.StatusCode.FAILED_PRECONDITION and "key reused" in details
    assert service.runs["acct"] == 1 and interceptor.counters.mismatch == 1


async def test_the_fingerprint_ignores_map_order_and_the_key_itself(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    async with serving([interceptor]) as (service, channel):
        first = charge(tags={"a": "1", "b": "2"})
        second = pb2.ChargeRequest(account="acct", amount=500, request_id="req-1")
        second.tags["b"] = "2"
        second.tags["a"] = "1"
        await call(channel, first)
        again = await call(channel, second)
    assert again[0] == grpc.StatusCode.OK and service.runs["acct"] == 1


async def test_a_duplicate_while_the_first_runs_is_aborted_with_retry_after(
    store: RedisStore,
) -> None:
    interceptor = AsyncIdempotencyInterceptor(store, retry_after_seconds=2.5)
    async with serving([interceptor]) as (service, channel):
        first = asyncio.ensure_future(call(channel, charge(account="gate")))
        await service.started.wait()
        status, details, trailing, _ = await call(channel, charge(account="gate"))
        service.gate.set()
        assert (await first)[0] == grpc.StatusCode.OK
    assert status == grpc.StatusCode.ABORTED and "still running" in details
    assert trailing["retry-after"] == "3"
    assert service.runs["gate"] == 1 and interceptor.counters.in_flight == 1


async def test_with_wait_seconds_a_duplicate_waits_for_the_answer(store: RedisStore) -> None:
    interceptor = AsyncIdempotencyInterceptor(store, wait_seconds=10)
    async with serving([interceptor]) as (service, channel):
        first = asyncio.ensure_future(call(channel, charge(account="gate")))
        await service.started.wait()
        second = asyncio.ensure_future(call(channel, charge(account="gate")))
        await until(lambda: interceptor.counters.claimed == 1)
        service.gate.set()
        one, two = await first, await second
    assert one[3] == two[3] and two[2]["idempotent-replayed"] == "true"
    assert service.runs["gate"] == 1


async def test_twenty_concurrent_duplicates_run_the_handler_once(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    async with serving([interceptor]) as (service, channel):
        results = await asyncio.gather(*(call(channel, charge()) for _ in range(20)))
        after = await call(channel, charge())
    assert service.runs["acct"] == 1
    codes = {r[0] for r in results}
    assert codes <= {grpc.StatusCode.OK, grpc.StatusCode.ABORTED}
    assert {r[3] for r in results if r[0] == grpc.StatusCode.OK} == {after[3]}


@pytest.mark.parametrize("code", ["NOT_FOUND", "INVALID_ARGUMENT", "FAILED_PRECONDITION"])
async def test_a_definitive_error_is_kept_and_replayed(
    interceptor: AsyncIdempotencyInterceptor, code: str
) -> None:
    async with serving([interceptor]) as (service, channel):
        first = await call(channel, charge(account=f"abort:{code}"))
        again = await call(channel, charge(account=f"abort:{code}"))
    assert first[:2] == again[:2] == (grpc.StatusCode[code], "refused 500")
    assert first[2]["reason"] == again[2]["reason"] == "test"
    assert again[2]["idempotent-replayed"] == "true"
    assert service.runs[f"abort:{code}"] == 1


async def test_an_abort_is_held_until_the_outcome_is_kept(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    """The client has its NOT_FOUND only once it is stored: a duplicate sent the moment the
    first answer arrives is a replay, never "in flight" (grpc.aio's own abort sends the
    status before the interceptor could keep it)."""
    async with serving([interceptor]) as (service, channel):
        for i in range(20):
            request = charge(key=f"k{i}", account="abort:NOT_FOUND")
            assert (await call(channel, request))[0] == grpc.StatusCode.NOT_FOUND
            status, _, trailing, _ = await call(channel, request)
            assert status == grpc.StatusCode.NOT_FOUND and trailing["idempotent-replayed"]
    assert service.runs["abort:NOT_FOUND"] == 20 and interceptor.counters.in_flight == 0


async def test_set_code_and_details_are_kept_as_an_abort_is(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    async with serving([interceptor]) as (service, channel):
        first = await call(channel, charge(account="code:ALREADY_EXISTS"))
        again = await call(channel, charge(account="code:ALREADY_EXISTS"))
    assert first[:2] == again[:2] == (grpc.StatusCode.ALREADY_EXISTS, "set 500")
    assert service.runs["code:ALREADY_EXISTS"] == 1


@pytest.mark.parametrize("code", ["UNAVAILABLE", "INTERNAL", "ABORTED", "PERMISSION_DENIED"])
async def test_a_transient_error_releases_the_key_and_the_retry_runs(
    interceptor: AsyncIdempotencyInterceptor, code: str
) -> None:
    async with serving([interceptor]) as (service, channel):
        first = await call(channel, charge(account=f"abort:{code}"))
        again = await call(channel, charge(account=f"abort:{code}"))
    assert first[:2] == again[:2] == (grpc.StatusCode[code], "refused 500")
    assert "idempotent-replayed" not in again[2]
    assert service.runs[f"abort:{code}"] == 2 and interceptor.counters.released == 2


async def test_an_exception_in_the_handler_releases_the_key(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    async with serving([interceptor]) as (service, channel):
        for _ in range(2):
            status, *_ = await call(channel, charge(account="raise"))
            assert status == grpc.StatusCode.UNKNOWN
    assert service.runs["raise"] == 2 and interceptor.counters.released == 2


async def test_outcome_chooses_the_statuses_kept(store: RedisStore) -> None:
    only_ok = AsyncIdempotencyInterceptor(store, outcome={grpc.StatusCode.OK})
    async with serving([only_ok]) as (service, channel):
        for _ in range(2):
            await call(channel, charge(account="abort:NOT_FOUND"))
    assert service.runs["abort:NOT_FOUND"] == 2
    also = AsyncIdempotencyInterceptor(
        store, outcome=lambda code: code in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE)
    )
    async with serving([also]) as (service, channel):
        for _ in range(2):
            await call(channel, charge(key="other", account="abort:UNAVAILABLE"))
    assert service.runs["abort:UNAVAILABLE"] == 1


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"outcome": [200]}, TypeError),
        ({"outcome": "OK"}, TypeError),
        ({"methods": ["Charge"]}, ValueError),
        ({"methods": "/payments.Payments/Charge"}, TypeError),
        ({"key_field": "request-id"}, TypeError),
        ({"ttl_seconds": 0}, ValueError),
    ],
)
def test_a_wrong_option_is_refused_when_the_interceptor_is_made(
    store: RedisStore, options: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        AsyncIdempotencyInterceptor(store, **options)


async def test_a_store_that_is_down_is_unavailable_and_runs_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0")
    interceptor = AsyncIdempotencyInterceptor(store)
    try:
        async with serving([interceptor]) as (service, channel):
            status, details, *_ = await call(channel, charge())
    finally:
        await store.aclose()
    assert status == grpc.StatusCode.UNAVAILABLE and "store is unavailable" in details
    assert service.runs["acct"] == 0 and interceptor.counters.store_errors == 1
    assert any("answering UNAVAILABLE" in r.getMessage() for r in caplog.records)


async def test_a_deadline_that_passes_cancels_the_run_and_releases_the_key(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    async with serving([interceptor]) as (service, channel):
        c = raw(channel)(charge(account="gate"), timeout=0.5)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await c
        assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.wait_for(service.cancelled.wait(), 10)
        await until(lambda: interceptor.counters.released == 1)
        service.gate.set()
        status, *_ = await call(channel, charge(account="gate"))
    assert status == grpc.StatusCode.OK and service.runs["gate"] == 2


async def test_a_client_that_cancels_releases_the_key(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    async with serving([interceptor]) as (service, channel):
        c = raw(channel)(charge(account="gate"))
        await service.started.wait()
        c.cancel()
        await asyncio.wait_for(service.cancelled.wait(), 10)
        await until(lambda: interceptor.counters.released == 1)
        service.gate.set()
        status, *_ = await call(channel, charge(account="gate"))
    assert status == grpc.StatusCode.OK and service.runs["gate"] == 2


async def test_a_response_over_max_response_bytes_is_not_replayable(store: RedisStore) -> None:
    interceptor = AsyncIdempotencyInterceptor(store, max_response_bytes=1024)
    async with serving([interceptor]) as (service, channel):
        first = await call(channel, charge(account="big"))
        again = await call(channel, charge(account="big"))
    assert first[0] == grpc.StatusCode.OK and len(first[3] or b"") > 4096
    assert again[0] == grpc.StatusCode.ALREADY_EXISTS and "too large" in again[1]
    assert service.runs["big"] == 1 and interceptor.counters.too_large == 1


async def test_methods_limits_the_calls_covered(store: RedisStore) -> None:
    interceptor = AsyncIdempotencyInterceptor(store, methods=["/payments.Payments/Echo"])
    async with serving([interceptor]) as (service, channel):
        for _ in range(2):
            await call(channel, charge())
    assert service.runs["acct"] == 2


async def test_callers_with_other_credentials_never_share_a_key(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    async with serving([interceptor]) as (service, channel):
        alice = await call(channel, charge(), (("authorization", "Bearer alice"),))
        bob = await call(channel, charge(), (("authorization", "Bearer bob"),))
        alice_again = await call(channel, charge(), (("authorization", "Bearer alice"),))
    assert alice[3] != bob[3] and alice_again[3] == alice[3]
    assert service.runs["acct"] == 2


async def test_scope_names_the_caller(store: RedisStore) -> None:
    def tenant(context: grpc.aio.ServicerContext[Any, Any]) -> str:
        return dict(context.invocation_metadata() or ())["tenant"]

    interceptor = AsyncIdempotencyInterceptor(store, scope=tenant)
    async with serving([interceptor]) as (service, channel):
        await call(channel, charge(), (("tenant", "a"), ("authorization", "x")))
        same = await call(channel, charge(), (("tenant", "a"), ("authorization", "y")))
        other = await call(channel, charge(), (("tenant", "b"),))
    assert same[2]["idempotent-replayed"] == "true" and "idempotent-replayed" not in other[2]
    assert service.runs["acct"] == 2


async def test_a_lost_lease_is_counted_and_logged_as_http_does(
    store: RedisStore, caplog: pytest.LogCaptureFixture
) -> None:
    interceptor = AsyncIdempotencyInterceptor(store, lease_seconds=1)
    async with serving([interceptor]) as (service, channel):
        first = asyncio.ensure_future(call(channel, charge(account="gate")))
        await service.started.wait()
        claims = [k async for k in store.client.scan_iter(match=b"grpc:*:c")]
        await store.client.delete(*claims)  # an operator's delete, or a lapse
        with caplog.at_level(logging.WARNING, logger="goblin_idem.lease"):
            await until(lambda: interceptor.counters.lease_lost == 1)
        service.gate.set()
        assert (await first)[0] == grpc.StatusCode.OK
    assert any("lease lost" in r.getMessage() for r in caplog.records)


async def test_every_status_is_kept_or_released_as_the_issue_lists(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    kept = {"INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "FAILED_PRECONDITION"}
    kept |= {"OUT_OF_RANGE", "UNIMPLEMENTED"}
    codes = [c.name for c in grpc.StatusCode if c != grpc.StatusCode.OK]
    async with serving([interceptor]) as (service, channel):
        for code in codes:
            for _ in range(2):
                await call(channel, charge(key=f"k-{code}", account=f"abort:{code}"))
    assert {code for code in codes if service.runs[f"abort:{code}"] == 1} == kept
    assert all(service.runs[f"abort:{code}"] == 2 for code in codes if code not in kept)


async def test_an_unreadable_stored_outcome_is_internal_and_runs_nothing(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    async with serving([interceptor]) as (service, channel):
        await call(channel, charge())
        (result,) = [k async for k in store_of(interceptor).client.scan_iter(match=b"grpc:*:r")]
        await store_of(interceptor).client.set(result, b"GO\x01not an outcome")
        status, details, *_ = await call(channel, charge())
    assert status == grpc.StatusCode.INTERNAL and "cannot be read" in details
    assert service.runs["acct"] == 1 and interceptor.counters.unreadable == 1


async def test_sealed_outcomes_replay_and_on_event_sees_each_count(store: RedisStore) -> None:
    seen: list[tuple[str, str]] = []
    interceptor = AsyncIdempotencyInterceptor(
        store, encryption_keys=[bytes(range(32))], on_event=lambda e, k: seen.append((e, k))
    )
    async with serving([interceptor]) as (service, channel):
        first = await call(channel, charge())
        again = await call(channel, charge())
        (result,) = [k async for k in store.client.scan_iter(match=b"grpc:*:r")]
        stored = await store.client.get(result)
    assert again[3] == first[3] and service.runs["acct"] == 1
    assert stored[:3] == b"GO\x04" and b"ch_1" not in stored  # sealed, with its fingerprint
    assert [event for event, _ in seen] == ["claimed", "replayed"]
    assert seen[0][1] == seen[1][1] and len(seen[0][1]) == 32


def store_of(interceptor: AsyncIdempotencyInterceptor) -> Any:
    return interceptor._door.store
