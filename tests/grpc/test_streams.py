"""The method kinds on a real grpc.aio server: a server stream kept whole and replayed in
order, a client stream fingerprinted message by message, a bidirectional stream passed
through with a WARNING."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pytest

from goblin_idem.grpc import AsyncIdempotencyInterceptor
from tests.grpc.conftest import pb2, serving

SPLIT = "/payments.Payments/Split"
BATCH = "/payments.Payments/Batch"
CHAT = "/payments.Payments/Chat"


async def split(
    channel: grpc.aio.Channel, request: Any
) -> tuple[list[bytes], grpc.StatusCode, dict[str, Any]]:
    call = channel.unary_stream(SPLIT, request_serializer=lambda m: m.SerializeToString())(request)
    messages = []
    try:
        async for message in call:
            messages.append(message)
    except grpc.aio.AioRpcError:
        pass
    return messages, await call.code(), dict(await call.trailing_metadata() or ())


async def batch(
    channel: grpc.aio.Channel, items: list[Any], metadata: tuple[tuple[str, str], ...] = ()
) -> tuple[grpc.StatusCode, str, bytes | None]:
    call = channel.stream_unary(BATCH, request_serializer=lambda m: m.SerializeToString())(
        iter(items), metadata=metadata
    )
    try:
        body = await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or "", None
    return await call.code(), "", body


async def test_a_server_stream_is_replayed_whole_and_in_order(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    request = pb2.ChargeRequest(request_id="s-1", account="acct", amount=3)
    async with serving([interceptor]) as (service, channel):
        first = await split(channel, request)
        again = await split(channel, request)
    assert len(first[0]) == 3 and again[0] == first[0]
    assert [pb2.ChargeReply.FromString(m).charge_id for m in again[0]] == [
        "part_1_0",
        "part_1_1",
        "part_1_2",
    ]
    assert again[1] == grpc.StatusCode.OK and again[2]["idempotent-replayed"] == "true"
    assert service.runs["split"] == 1


async def test_a_server_stream_that_ends_in_a_kept_error_replays_its_messages_and_status(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    request = pb2.ChargeRequest(request_id="s-2", account="abort:NOT_FOUND")
    async with serving([interceptor]) as (service, channel):
        first = await split(channel, request)
        again = await split(channel, request)
    assert first[1] == again[1] == grpc.StatusCode.NOT_FOUND
    assert len(first[0]) == 1 and again[0] == first[0]
    assert service.runs["split"] == 1


async def test_a_server_stream_over_max_response_bytes_is_not_replayable(store: Any) -> None:
    interceptor = AsyncIdempotencyInterceptor(store, max_response_bytes=20)
    request = pb2.ChargeRequest(request_id="s-3", account="acct")
    async with serving([interceptor]) as (service, channel):
        first = await split(channel, request)
        again = await split(channel, request)
    assert len(first[0]) == 3 and first[1] == grpc.StatusCode.OK
    assert again[0] == [] and again[1] == grpc.StatusCode.ALREADY_EXISTS
    assert service.runs["split"] == 1


async def test_a_client_stream_is_fingerprinted_message_by_message(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    items = [pb2.Item(request_id="b-1", amount=2), pb2.Item(amount=3)]
    async with serving([interceptor]) as (service, channel):
        first = await batch(channel, items)
        again = await batch(channel, [pb2.Item(request_id="b-1", amount=2), pb2.Item(amount=3)])
        other = await batch(channel, [pb2.Item(request_id="b-1", amount=2), pb2.Item(amount=4)])
        shorter = await batch(channel, [pb2.Item(request_id="b-1", amount=2)])
    assert first[0] == again[0] == grpc.StatusCode.OK and again[2] == first[2]
    assert pb2.ChargeReply.FromString(first[2]).amount == 5
    assert other[0] == shorter[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert service.runs["batch"] == 1


async def test_a_later_message_naming_another_key_is_invalid_argument(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    items = [pb2.Item(request_id="b-1", amount=2), pb2.Item(request_id="b-2", amount=3)]
    async with serving([interceptor]) as (service, channel):
        status, details, _ = await batch(channel, items)
        same = await batch(channel, [pb2.Item(request_id="b-3"), pb2.Item(request_id="b-3")])
    assert status == grpc.StatusCode.INVALID_ARGUMENT and "two request_ids" in details
    assert same[0] == grpc.StatusCode.OK and service.runs["batch"] == 1


async def test_a_client_stream_keyed_by_metadata(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    keyed = (("idempotency-key", "m-1"),)
    async with serving([interceptor]) as (service, channel):
        first = await batch(channel, [pb2.Item(amount=1)], keyed)
        again = await batch(channel, [pb2.Item(amount=1)], keyed)
        bare = await batch(channel, [pb2.Item(amount=1)])
    assert again[2] == first[2] and bare[0] == grpc.StatusCode.OK
    assert service.runs["batch"] == 2


async def test_a_bidirectional_stream_passes_through_with_one_warning(
    interceptor: AsyncIdempotencyInterceptor, caplog: pytest.LogCaptureFixture
) -> None:
    async with serving([interceptor]) as (service, channel):
        chat = channel.stream_stream(
            CHAT,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb2.Item.FromString,
        )
        with caplog.at_level(logging.WARNING, logger="goblin_idem.grpc"):
            for _ in range(2):
                replies = [r async for r in chat(iter([pb2.Item(request_id="c-1", amount=7)]))]
                assert [r.amount for r in replies] == [7]
    assert service.runs["chat"] == 2
    warnings = [r for r in caplog.records if "bidirectional" in r.getMessage()]
    assert len(warnings) == 1 and CHAT in warnings[0].getMessage()


async def test_a_server_stream_without_a_key_passes_through(
    interceptor: AsyncIdempotencyInterceptor,
) -> None:
    request = pb2.ChargeRequest(account="acct")
    async with serving([interceptor]) as (service, channel):
        first = await split(channel, request)
        again = await split(channel, request)
    assert len(first[0]) == len(again[0]) == 3 and first[0] != again[0]
    assert "idempotent-replayed" not in again[2] and service.runs["split"] == 2
