"""Webhook receivers under uvicorn, on Redis and on Redis with SQL records on PostgreSQL:
every provider's deliveries signed by its own library (or its documented algorithm), as
issues 34 and 42 list the cases."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.support.apps.webhook_app import GITHUB_HOOK_SECRETS, MAX_BODY_BYTES
from tests.support.servers import Server
from tests.support.webhooks import (
    PROVIDERS,
    SIGNED_IDS,
    TIMESTAMPED,
    UNSIGNED_IDS,
    Delivery,
    delivery,
    event_body,
    forged,
)
from tests.webhooks.conftest import Receiver, running_receiver

pytestmark = pytest.mark.timeout(60)
by_provider = pytest.mark.parametrize("provider", PROVIDERS)


@pytest.fixture
async def client(receiver: Receiver) -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=50)
    async with httpx.AsyncClient(base_url=receiver.url, limits=limits, timeout=20) as c:
        yield c


def fresh(provider: str, mode: str = "", **kwargs: object) -> tuple[str, str, Delivery]:
    """A new event id and ref, and the event's genuine delivery."""
    event_id = f"evt_{uuid.uuid4().hex}"
    ref = uuid.uuid4().hex
    return event_id, ref, delivery(provider, event_id, event_body(event_id, ref, mode), **kwargs)  # type: ignore[arg-type]


async def post(client: httpx.AsyncClient, d: Delivery) -> httpx.Response:
    return await client.post(d.path, content=d.body, headers=d.headers)


async def runs(client: httpx.AsyncClient, ref: str) -> int:
    counts: dict[str, int] = (await client.get("/counts")).json()
    return counts.get(ref, 0)


def slug(response: httpx.Response) -> str:
    assert response.headers["content-type"] == "application/problem+json"
    return str(response.json()["type"]).rsplit(":", 1)[1]


@by_provider
async def test_genuine_delivery_runs_once_and_reads_its_body(
    client: httpx.AsyncClient, provider: str
) -> None:
    _, ref, genuine = fresh(provider)
    response = await post(client, genuine)
    assert response.status_code == 200, response.text
    assert response.json() == {"ref": ref, "size": len(genuine.body)}
    assert "idempotent-replayed" not in response.headers
    assert await runs(client, ref) == 1


@by_provider
async def test_redelivery_signed_afresh_is_replayed(
    client: httpx.AsyncClient, provider: str
) -> None:
    event_id, ref, first = fresh(provider, timestamp=time.time() - 30)
    again = delivery(provider, event_id, first.body)  # a new timestamp, a new signature
    if provider in TIMESTAMPED:
        assert again.headers != first.headers
    one = await post(client, first)
    two = await post(client, again)
    assert one.status_code == two.status_code == 200
    assert two.content == one.content
    assert two.headers["idempotent-replayed"] == "true"
    assert await runs(client, ref) == 1


@pytest.mark.parametrize("provider", SIGNED_IDS)
async def test_verified_id_with_another_body_is_refused(
    client: httpx.AsyncClient, provider: str
) -> None:
    event_id, ref, first = fresh(provider)
    other = delivery(provider, event_id, event_body(event_id, ref + "-other"))
    assert (await post(client, first)).status_code == 200
    response = await post(client, other)
    assert (response.status_code, slug(response)) == (422, "key-reused")
    assert await runs(client, ref + "-other") == 0


@pytest.mark.parametrize("provider", UNSIGNED_IDS)
async def test_another_signed_body_under_an_unsigned_id_is_another_delivery(
    client: httpx.AsyncClient, provider: str
) -> None:
    """The id header is not signed, so it says nothing of which event a body is: each
    signed body is its own delivery, whatever id it came under."""
    event_id, ref, first = fresh(provider)
    other = delivery(provider, event_id, event_body(event_id, ref + "-other"))
    assert (await post(client, first)).status_code == 200
    response = await post(client, other)
    assert response.status_code == 200 and "idempotent-replayed" not in response.headers
    assert (await runs(client, ref), await runs(client, ref + "-other")) == (1, 1)


@by_provider
async def test_forged_first_claims_nothing_and_genuine_runs_once(
    client: httpx.AsyncClient, receiver: Receiver, provider: str
) -> None:
    _, ref, genuine = fresh(provider)
    before = receiver.stored_keys()
    response = await post(client, forged(genuine))
    assert (response.status_code, slug(response)) == (401, "webhook-unverified")
    assert receiver.stored_keys() == before  # nothing claimed, nothing stored
    assert await runs(client, ref) == 0
    assert (await post(client, genuine)).status_code == 200
    assert await runs(client, ref) == 1
    response = await post(client, forged(genuine))  # nor can it be answered afterwards
    assert response.status_code == 401


@by_provider
async def test_forged_and_genuine_concurrently(client: httpx.AsyncClient, provider: str) -> None:
    refs = []
    for _ in range(100):
        _, ref, genuine = fresh(provider)
        refs.append(ref)
        bad, good = await asyncio.gather(post(client, forged(genuine)), post(client, genuine))
        assert bad.status_code == 401
        assert good.status_code == 200, good.text  # never 409: the forger held nothing
    counts = (await client.get("/counts")).json()
    assert [counts.get(ref) for ref in refs] == [1] * len(refs)


@pytest.mark.parametrize("provider", TIMESTAMPED)
async def test_stale_timestamp_is_refused_and_the_retry_runs(
    client: httpx.AsyncClient, receiver: Receiver, provider: str
) -> None:
    # A minute past the 300 s tolerance either way: timestamps are whole seconds (truncated),
    # and the receiver reads its clock later, on a loaded machine a second or more later.
    event_id, ref, stale = fresh(provider, timestamp=time.time() - 360)
    before = receiver.stored_keys()
    response = await post(client, stale)
    assert (response.status_code, slug(response)) == (401, "webhook-unverified")
    assert "timestamp" in response.json()["detail"]
    assert receiver.stored_keys() == before
    future = delivery(provider, event_id, stale.body, timestamp=time.time() + 360)
    assert (await post(client, future)).status_code == 401
    retry = delivery(provider, event_id, stale.body)
    assert (await post(client, retry)).status_code == 200
    assert await runs(client, ref) == 1


@by_provider
async def test_wrong_secret_is_refused(
    client: httpx.AsyncClient, receiver: Receiver, provider: str
) -> None:
    _, ref, genuine = fresh(provider)
    before = receiver.stored_keys()
    response = await post(client, forged(genuine))
    assert response.status_code == 401
    assert receiver.stored_keys() == before
    assert await runs(client, ref) == 0
    unsigned = Delivery(genuine.path, {**genuine.headers}, genuine.body)
    for name in ("webhook-signature", "svix-signature", "stripe-signature"):
        unsigned.headers.pop(name, None)
    unsigned.headers.pop("x-hub-signature-256", None)
    unsigned.headers.pop("x-shopify-hmac-sha256", None)
    response = await post(client, unsigned)
    assert (response.status_code, slug(response)) == (401, "webhook-unverified")


@by_provider
async def test_rotated_secrets_each_verify(client: httpx.AsyncClient, provider: str) -> None:
    _, ref, old = fresh(provider, secret=1)  # signed with the secret being rotated out
    assert (await post(client, old)).status_code == 200
    assert await runs(client, ref) == 1


async def test_standard_webhooks_header_with_several_signatures(
    client: httpx.AsyncClient,
) -> None:
    """A sender rotating its secret signs with both, space-separated: one verifying is enough."""
    _, ref, genuine = fresh("standard")
    wrong = forged(genuine).headers["webhook-signature"]
    both = f"{wrong} {genuine.headers['webhook-signature']}"
    response = await post(
        client, Delivery(genuine.path, {**genuine.headers, "webhook-signature": both}, genuine.body)
    )
    assert response.status_code == 200
    assert await runs(client, ref) == 1


_ID_HEADERS = {  # the delivery id of each provider that sends one in a header
    "standard": "webhook-id",
    "svix": "svix-id",
    "github": "x-github-delivery",
    "shopify": "x-shopify-event-id",
}


@pytest.mark.parametrize("provider", SIGNED_IDS)
async def test_missing_delivery_id_is_malformed(
    client: httpx.AsyncClient, receiver: Receiver, provider: str
) -> None:
    ref = uuid.uuid4().hex
    if provider == "stripe":  # the id is in the (signed) body
        body = json.dumps({"ref": ref, "type": "invoice.paid"}).encode()
        d = delivery(provider, "", body)
    else:
        _, ref, d = fresh(provider)
        d.headers.pop(_ID_HEADERS[provider])
    before = receiver.stored_keys()
    response = await post(client, d)
    assert (response.status_code, slug(response)) == (400, "webhook-malformed")
    assert receiver.stored_keys() == before
    assert await runs(client, ref) == 0


@by_provider
async def test_body_over_the_limit_is_refused_before_verification(
    client: httpx.AsyncClient, receiver: Receiver, provider: str
) -> None:
    event_id = f"evt_{uuid.uuid4().hex}"
    ref = uuid.uuid4().hex
    big = delivery(provider, event_id, event_body(event_id, ref, size=MAX_BODY_BYTES + 1))
    before = receiver.stored_keys()
    response = await post(client, big)
    assert (response.status_code, slug(response)) == (413, "body-too-large")

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it is read
        yield big.body[:1000]
        yield big.body[1000:]

    streamed = await client.post(big.path, content=chunks(), headers=big.headers)
    assert streamed.status_code == 413
    assert receiver.stored_keys() == before
    assert await runs(client, ref) == 0


async def test_same_id_at_every_provider_and_route_runs_at_each(client: httpx.AsyncClient) -> None:
    """Two providers, or two routes of one provider, never share a key space."""
    event_id = f"evt_{uuid.uuid4().hex}"
    sent = []
    for provider in ("standard", "stripe", "github", "shopify"):
        ref = f"{provider}-{event_id}"
        sent.append((ref, delivery(provider, event_id, event_body(event_id, ref))))
    ref = f"by-path-{event_id}"
    by_path = delivery("standard", event_id, event_body(event_id, ref), path="/by-path/standard")
    sent.append((ref, by_path))
    for _, d in sent:
        response = await post(client, d)
        assert response.status_code == 200, (d.path, response.text)
        assert "idempotent-replayed" not in response.headers
    counts = (await client.get("/counts")).json()
    assert [counts.get(ref) for ref, _ in sent] == [1] * len(sent)


@by_provider
async def test_handler_raising_then_the_retry_runs_once(
    client: httpx.AsyncClient, provider: str
) -> None:
    event_id, ref, first = fresh(provider, mode="raise-once")
    # uvicorn closes a connection whose app raised: this one, not the pool's next request's
    closing = Delivery(first.path, {**first.headers, "connection": "close"}, first.body)
    response = await post(client, closing)
    assert response.status_code == 500
    retry = delivery(provider, event_id, first.body)
    assert (await post(client, retry)).status_code == 200
    again = delivery(provider, event_id, first.body)
    assert (await post(client, again)).headers["idempotent-replayed"] == "true"
    assert await runs(client, ref) == 1


async def test_configured_by_path_on_the_middleware(
    client: httpx.AsyncClient, receiver: Receiver
) -> None:
    event_id, ref, genuine = fresh("standard", path="/by-path/standard")
    assert (await post(client, forged(genuine))).status_code == 401
    assert (await post(client, genuine)).status_code == 200
    again = delivery("standard", event_id, genuine.body, path="/by-path/standard")
    assert (await post(client, again)).headers["idempotent-replayed"] == "true"
    assert await runs(client, ref) == 1


async def test_refusals_are_logged_without_secret_or_signature(
    client: httpx.AsyncClient, receiver: Receiver
) -> None:
    _, _, genuine = fresh("stripe")
    bad = forged(genuine)
    assert (await post(client, bad)).status_code == 401
    log = receiver.log.read_text()  # written (stderr, line-buffered) before the answer
    assert "webhook delivery to /hooks/stripe (stripe) refused" in log
    signature = bad.headers["stripe-signature"].split("v1=")[1]
    assert signature not in log
    assert "whsec_" not in log


def resent(d: Delivery, **headers: str) -> Delivery:
    """`d` as captured, its body and signature intact, with some (unsigned) headers changed."""
    return Delivery(d.path, {**d.headers, **headers}, d.body)


@pytest.mark.parametrize("provider", UNSIGNED_IDS)
async def test_a_captured_body_resent_under_new_ids_is_replayed(
    client: httpx.AsyncClient, provider: str
) -> None:
    """The delivery id (and GitHub's hook id) is not signed: a body re-sent under new ids,
    a forger's or the provider's own manual redelivery, is the same delivery. Before the key
    came from the signed body, GitHub ran this body 11 times, Shopify 6."""
    _, ref, genuine = fresh(provider)
    first = await post(client, genuine)
    assert first.status_code == 200
    id_header = _ID_HEADERS[provider]
    copies = [resent(genuine, **{id_header: str(uuid.uuid4())}) for _ in range(5)]
    if provider == "github":
        copies += [resent(genuine, **{"x-github-hook-id": str(n)}) for n in range(2, 7)]
    copies.append(
        Delivery(
            genuine.path, {k: v for k, v in genuine.headers.items() if k != id_header}, genuine.body
        )
    )
    for copy in copies:
        response = await post(client, copy)
        assert response.status_code == 200, response.text
        assert response.content == first.content
        assert response.headers["idempotent-replayed"] == "true"
    assert await runs(client, ref) == 1


@pytest.mark.parametrize("provider", UNSIGNED_IDS)
async def test_a_captured_body_sent_first_under_another_events_id_blocks_nothing(
    client: httpx.AsyncClient, provider: str
) -> None:
    """Event A's genuine body, re-sent under event B's id before B arrives, used to hold B's
    key with A's body: B and every retry of it got 422 key-reused, and B never ran."""
    _, ref_a, a = fresh(provider)
    event_b, ref_b, b = fresh(provider)
    assert (await post(client, a)).status_code == 200
    hijack = await post(client, resent(a, **{_ID_HEADERS[provider]: event_b}))
    assert hijack.status_code == 200 and hijack.headers["idempotent-replayed"] == "true"
    first = await post(client, b)
    assert first.status_code == 200, first.text
    assert "idempotent-replayed" not in first.headers
    retry = await post(client, b)
    assert retry.status_code == 200 and retry.headers["idempotent-replayed"] == "true"
    assert (await runs(client, ref_a), await runs(client, ref_b)) == (1, 1)


_SIGNATURE_HEADERS = {
    "standard": "webhook-signature",
    "svix": "svix-signature",
    "stripe": "stripe-signature",
    "github": "x-hub-signature-256",
    "shopify": "x-shopify-hmac-sha256",
}


@by_provider
async def test_a_header_the_provider_reads_sent_twice_is_malformed(
    client: httpx.AsyncClient, receiver: Receiver, provider: str
) -> None:
    """Two values of a header the provider reads (the genuine one last): the provider would
    verify one and the handler read the other (Starlette reads the first), so neither runs."""
    _, ref, genuine = fresh(provider)
    decoys = {_SIGNATURE_HEADERS[provider]: forged(genuine).headers[_SIGNATURE_HEADERS[provider]]}
    if provider in SIGNED_IDS and provider != "stripe":
        decoys[_ID_HEADERS[provider]] = f"evt_{uuid.uuid4().hex}"
    before = receiver.stored_keys()
    for name, decoy in decoys.items():
        headers = [(k, v) for k, v in genuine.headers.items() if k != name]
        headers += [(name, decoy), (name, genuine.headers[name])]
        response = await client.post(genuine.path, content=genuine.body, headers=headers)
        assert (response.status_code, slug(response)) == (400, "webhook-malformed"), name
        assert name in response.json()["detail"]
    assert receiver.stored_keys() == before
    assert await runs(client, ref) == 0
    assert (await post(client, genuine)).status_code == 200
    assert await runs(client, ref) == 1


async def test_a_stripe_signature_without_a_v1_entry_is_refused(
    client: httpx.AsyncClient, receiver: Receiver
) -> None:
    """A timestamp alone, or with only schemes that are not v1, verifies nothing."""
    _, ref, genuine = fresh("stripe")
    stamp = genuine.headers["stripe-signature"].split(",")[0]
    assert stamp.startswith("t=")
    v1 = genuine.headers["stripe-signature"].split("v1=")[1]
    before = receiver.stored_keys()
    for header in (stamp, f"{stamp},v1=", f"{stamp},v0={v1}", f"{stamp},v1 ={v1}"):
        response = await post(client, resent(genuine, **{"stripe-signature": header}))
        assert (response.status_code, slug(response)) == (401, "webhook-unverified"), header
    assert receiver.stored_keys() == before
    assert await runs(client, ref) == 0


async def test_github_hooks_with_a_secret_each_run_each_and_the_hook_id_is_checked(
    client: httpx.AsyncClient, receiver: Receiver
) -> None:
    """``GitHub(hooks={id: [secret]})``: one event's body from two hooks runs once per hook;
    a hook's signed body under another hook's id (or none) does not verify."""
    event_id, ref = f"evt_{uuid.uuid4().hex}", uuid.uuid4().hex
    body = event_body(event_id, ref)
    path = "/hooks/github-hooks"
    repo, org = (
        delivery("github", event_id, body, secret=GITHUB_HOOK_SECRETS[h][0], hook_id=h, path=path)
        for h in ("1", "2")
    )
    before = receiver.stored_keys()
    for hook in ("2", "3", ""):
        response = await post(client, resent(repo, **{"x-github-hook-id": hook}))
        assert (response.status_code, slug(response)) == (401, "webhook-unverified"), hook
    assert receiver.stored_keys() == before
    for hook in (repo, org):
        response = await post(client, hook)
        assert response.status_code == 200 and "idempotent-replayed" not in response.headers
    again = await post(client, resent(repo, **{"x-github-delivery": str(uuid.uuid4())}))
    assert again.headers["idempotent-replayed"] == "true"
    assert await runs(client, ref) == 2


@pytest.mark.parametrize("provider", ["standard", "svix"])
async def test_both_spellings_of_a_standard_webhooks_header_must_agree(
    client: httpx.AsyncClient, receiver: Receiver, provider: str
) -> None:
    """``webhook-id`` verified while a ``svix-id`` beside it names another message (which
    Svix's own library reads first) is refused; the same values under both run."""
    _, ref, genuine = fresh(provider)
    mine, other = ("webhook-", "svix-") if provider == "standard" else ("svix-", "webhook-")
    copies = {other + part: genuine.headers[mine + part] for part in ("id", "timestamp")}
    before = receiver.stored_keys()
    for part in ("id", "timestamp"):
        decoy = {**copies, other + part: "1" + copies[other + part]}
        response = await post(client, resent(genuine, **decoy))
        assert (response.status_code, slug(response)) == (400, "webhook-malformed"), part
        assert f"webhook-{part} and svix-{part}" in response.json()["detail"]
    assert receiver.stored_keys() == before
    assert (await post(client, resent(genuine, **copies))).status_code == 200
    assert await runs(client, ref) == 1


async def test_marks_hold_when_the_middleware_wraps_the_app_from_outside(
    tmp_path: Path, redis_server: Server
) -> None:
    """``IdempotencyMiddleware(app, ...)`` runs before the app puts itself in the scope: the
    marks were read from nowhere, and a forged delivery to a @webhook route ran unverified."""
    app = "tests.support.apps.webhook_app:outer"
    with running_receiver(tmp_path, redis_server, None, app=app) as receiver:
        async with httpx.AsyncClient(base_url=receiver.url, timeout=20) as c:
            _, ref, genuine = fresh("standard")
            refused = await post(c, forged(genuine))
            assert (refused.status_code, slug(refused)) == (401, "webhook-unverified")
            assert await runs(c, ref) == 0
            first, again = await post(c, genuine), await post(c, genuine)
            assert first.status_code == 200 and again.headers["idempotent-replayed"] == "true"
            assert await runs(c, ref) == 1
