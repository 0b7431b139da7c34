"""Every reply-table row and example transcript of the four GOBLIN spec pages, per store.

The `backend` fixture runs each test against MemoryStore, against the Lua scripts on a
real redis-server 7 and valkey-server 9 (and natively where the module is loaded), and
against PostgresStore on a real PostgreSQL through each driver. Expiry rows use real short
leases: nothing here mocks a clock.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import ResponseError

from goblin_idem import CLAIMED
from goblin_idem.store import Store
from goblin_idem.store._server_errors import NOT_INTEGER, VALUE_TOO_LARGE, WRONGTYPE
from tests.support.backends import BACKENDS, POSTGRES_BACKENDS, Backend
from tests.support.waits import until

pytestmark = pytest.mark.parametrize("backend", BACKENDS + POSTGRES_BACKENDS, indirect=True)

BINARY_KEY = b"claim:\x00\xff\xfe{tag}\r\n"
BINARY_VALUE = b"\x00\x01\x80\xff not utf-8 \xc3\x28 \x00"
CLAIM_EXPIRE = "invalid expire time in 'goblin.claim' command"
CAEXPIRE_EXPIRE = "invalid expire time in 'goblin.caexpire' command"
NON_INTEGERS = [
    "abc",
    "1.5",
    1.5,
    30.0,
    "",
    " 30",
    "30 ",
    "+30",
    "030",
    "0x1e",
    None,
    True,
    2**63,
    -(2**63) - 1,
    "9223372036854775808",
]


async def raises(coro: object, text: str) -> None:
    with pytest.raises(ResponseError) as info:
        await coro  # type: ignore[misc]
    assert str(info.value) == text


# -- GOBLIN.CLAIM ---------------------------------------------------------------------------


async def test_claim_free_is_taken_with_a_lease(store: Store) -> None:
    assert await store.claim("claim:1", "result:1", "worker-3", 30) is CLAIMED
    assert await store.get("claim:1") == b"worker-3"  # the token is stored verbatim
    assert 29_000 < await store.pttl("claim:1") <= 30_000
    assert await store.get("result:1") is None  # CLAIM never writes the result


async def test_claim_held_with_result_replies_the_result(store: Store) -> None:
    assert await store.claim("claim:1", "result:1", "w1", 30) is CLAIMED
    await store.set("result:1", "charged:txn_551", ex=86400)
    assert await store.claim("claim:1", "result:1", "w2", 30) == b"charged:txn_551"
    assert await store.get("claim:1") == b"w1"  # a lost claim changes nothing


async def test_claim_held_without_result_replies_nil(store: Store) -> None:
    assert await store.claim("claim:1", "result:1", "w1", 30) is CLAIMED
    before = await store.pttl("claim:1")
    assert await store.claim("claim:1", "result:1", "w2", 30) is None
    assert await store.get("claim:1") == b"w1"
    assert await store.pttl("claim:1") <= before  # the lease was not restarted


@pytest.mark.parametrize("kind", ["hash", "zset"])
async def test_claim_held_with_non_string_result_is_wrongtype(backend: Backend, kind: str) -> None:
    store = backend.store
    await getattr(backend, f"make_{kind}")("result:1")
    # The claim is free: it is won, and the result is never read.
    assert await store.claim("claim:1", "result:1", "w1", 30) is CLAIMED
    await raises(store.claim("claim:1", "result:1", "w2", 30), WRONGTYPE)


@pytest.mark.parametrize("kind", ["hash", "zset"])
async def test_claim_key_of_another_type_just_fails_the_claim(backend: Backend, kind: str) -> None:
    store = backend.store
    await getattr(backend, f"make_{kind}")("claim:1")
    assert await store.claim("claim:1", "result:1", "w1", 30) is None  # no WRONGTYPE
    await store.set("result:1", "done")
    assert await store.claim("claim:1", "result:1", "w1", 30) == b"done"


@pytest.mark.parametrize("seconds", NON_INTEGERS)
async def test_claim_non_integer_seconds(store: Store, seconds: object) -> None:
    await raises(store.claim("claim:1", "result:1", "w1", seconds), NOT_INTEGER)  # type: ignore[arg-type]
    assert await store.pttl("claim:1") == -2  # nothing was touched


@pytest.mark.parametrize("seconds", [0, -1, "-5", 2**62, 2**63 // 1000 + 1, "9223372036854775807"])
async def test_claim_non_positive_or_overflowing_seconds(store: Store, seconds: object) -> None:
    await raises(store.claim("claim:1", "result:1", "w1", seconds), CLAIM_EXPIRE)  # type: ignore[arg-type]
    assert await store.pttl("claim:1") == -2


async def test_claim_seconds_as_decimal_string(store: Store) -> None:
    assert await store.claim("claim:1", "result:1", "w1", "7") is CLAIMED  # type: ignore[arg-type]
    assert 6_000 < await store.pttl("claim:1") <= 7_000


async def test_claim_elapsed_lease_reads_as_free(store: Store) -> None:
    assert await store.claim("claim:1", "result:1", "w1", 1) is CLAIMED
    assert await store.claim("claim:1", "result:1", "w2", 1) is None
    await asyncio.sleep(1.1)
    assert await store.claim("claim:1", "result:1", "w2", 5) is CLAIMED
    assert await store.get("claim:1") == b"w2"


async def test_claim_elapsed_result_reads_as_nil(store: Store) -> None:
    assert await store.claim("claim:1", "result:1", "w1", 30) is CLAIMED
    await store.set("result:1", "done", px=300)
    assert await store.claim("claim:1", "result:1", "w2", 30) == b"done"
    await asyncio.sleep(0.4)
    assert await store.claim("claim:1", "result:1", "w2", 30) is None


async def test_claim_binary_keys_token_and_result(store: Store) -> None:
    rk = BINARY_KEY + b"result"
    assert await store.claim(BINARY_KEY, rk, BINARY_VALUE, 30) is CLAIMED
    assert await store.get(BINARY_KEY) == BINARY_VALUE
    await store.set(rk, BINARY_VALUE * 3)
    assert await store.claim(BINARY_KEY, rk, b"other", 30) == BINARY_VALUE * 3
    # str and bytes name the same key (UTF-8)
    assert await store.claim("clé", "résultat", "w", 30) is CLAIMED
    assert await store.claim("clé".encode(), "résultat".encode(), "w", 30) is None


async def test_claim_empty_keys_and_token(store: Store) -> None:
    assert await store.claim("", "", "", 30) is CLAIMED
    assert await store.get("") == b""
    # The claim and the result are the same (empty) key here: the held claim reads itself.
    assert await store.claim("", "", "x", 30) == b""


async def test_claim_result_of_the_bytes_claimed_is_ambiguous_on_the_wire(store: Store) -> None:
    """A result equal to b"CLAIMED" replies exactly like a won claim, in every store.

    The wire cannot tell the bulk string CLAIMED from a stored value CLAIMED, so every
    store maps both to the sentinel; goblin-idem's records never equal those bytes.
    """
    assert await store.claim("claim:1", "result:1", "w1", 30) is CLAIMED
    await store.set("result:1", b"CLAIMED")
    assert await store.claim("claim:1", "result:1", "w2", 30) is CLAIMED
    assert await store.get("claim:1") == b"w1"  # ... although w2 did not win


async def test_claim_example_payment_webhook(store: Store) -> None:
    """The spec's transcript, with a 1 s lease standing in for 30 s."""
    assert await store.claim("claim:evt88", "result:evt88", "worker-3", 1) is CLAIMED
    # a duplicate that races in while worker-3 is still charging
    assert await store.claim("claim:evt88", "result:evt88", "worker-9", 1) is None
    # worker-3 crashes mid-charge and never publishes; after the lease:
    await asyncio.sleep(1.1)
    assert await store.claim("claim:evt88", "result:evt88", "worker-9", 30) is CLAIMED
    assert await store.set("result:evt88", "charged:txn_551", ex=86400)
    # a duplicate delivery of the same event, seconds later
    assert await store.claim("claim:evt88", "result:evt88", "worker-9", 30) == b"charged:txn_551"


async def test_claim_is_atomic_under_concurrency(store: Store) -> None:
    replies = await asyncio.gather(
        *(store.claim("claim:race", "result:race", f"w{i}", 30) for i in range(200))
    )
    assert sum(r is CLAIMED for r in replies) == 1
    assert replies.count(None) == 199


# -- GOBLIN.CAEXPIRE ------------------------------------------------------------------------


async def test_caexpire_match_sets_the_ttl(store: Store) -> None:
    await store.set("lock:job", "client-42-uuid", px=30000)
    assert await store.caexpire("lock:job", "client-42-uuid", 60000) == 1
    assert 59_000 < await store.pttl("lock:job") <= 60_000


async def test_caexpire_on_a_key_without_ttl_gives_it_one(store: Store) -> None:
    await store.set("lock:job", "tok")
    assert await store.pttl("lock:job") == -1
    assert await store.caexpire("lock:job", "tok", 5000) == 1
    assert 4_000 < await store.pttl("lock:job") <= 5_000


async def test_caexpire_mismatch_leaves_the_lease(store: Store) -> None:
    await store.set("lock:job", "client-42-uuid", px=30000)
    assert await store.caexpire("lock:job", "wrong-owner", 90000) == 0
    assert await store.pttl("lock:job") <= 30_000
    assert await store.get("lock:job") == b"client-42-uuid"


async def test_caexpire_missing_key(store: Store) -> None:
    assert await store.caexpire("lock:none", "tok", 30000) == 0
    assert await store.pttl("lock:none") == -2  # not created


async def test_caexpire_elapsed_key_is_missing(store: Store) -> None:
    await store.set("lock:job", "tok", px=200)
    await asyncio.sleep(0.3)
    assert await store.caexpire("lock:job", "tok", 30000) == 0
    assert await store.pttl("lock:job") == -2


@pytest.mark.parametrize("kind", ["hash", "zset"])
async def test_caexpire_non_string_is_wrongtype(backend: Backend, kind: str) -> None:
    await getattr(backend, f"make_{kind}")("lock:job")
    await raises(backend.store.caexpire("lock:job", "tok", 30000), WRONGTYPE)


@pytest.mark.parametrize("ms", NON_INTEGERS)
async def test_caexpire_non_integer_ms(store: Store, ms: object) -> None:
    await store.set("lock:job", "tok", px=30000)
    await raises(store.caexpire("lock:job", "tok", ms), NOT_INTEGER)  # type: ignore[arg-type]
    await raises(store.caexpire("lock:none", "tok", ms), NOT_INTEGER)  # type: ignore[arg-type]
    assert await store.pttl("lock:job") > 29_000


@pytest.mark.parametrize("ms", [0, -1, -30000, "-1", -(2**63)])
async def test_caexpire_non_positive_ms_deletes_and_replies_1(store: Store, ms: object) -> None:
    await store.set("lock:job", "tok", px=30000)
    assert await store.caexpire("lock:job", "other", ms) == 0  # type: ignore[arg-type]
    assert await store.get("lock:job") == b"tok"
    assert await store.caexpire("lock:job", "tok", ms) == 1  # type: ignore[arg-type]
    assert await store.pttl("lock:job") == -2


@pytest.mark.parametrize("ms", [2**63 - 1, 2**63 - 1000])
async def test_caexpire_overflowing_ms(store: Store, ms: int) -> None:
    await store.set("lock:job", "tok", px=30000)
    await raises(store.caexpire("lock:job", "tok", ms), CAEXPIRE_EXPIRE)
    assert await store.pttl("lock:job") > 29_000


async def test_caexpire_compare_is_byte_exact(store: Store) -> None:
    await store.set("lock:job", b"tok\x00en", px=30000)
    for near in [b"tok", b"tok\x00", b"tok\x00en ", b"TOK\x00en", b" tok\x00en", b""]:
        assert await store.caexpire("lock:job", near, 60000) == 0
    assert await store.caexpire("lock:job", b"tok\x00en", 60000) == 1


async def test_caexpire_renewal_outlives_the_first_lease(store: Store) -> None:
    await store.set("lock:job", "tok", px=400)
    await store.set("first-lease", "x", px=400)  # set after the lock: it lapses after it
    assert await store.caexpire("lock:job", "tok", 1000) == 1

    async def first_lease_over() -> bool:
        return await store.pttl("first-lease") == -2

    await until(first_lease_over, what="the first lease's end")
    assert await store.get("lock:job") == b"tok"


async def test_caexpire_example_transcript(store: Store) -> None:
    assert await store.set("lock:job", "client-42-uuid", px=30000, nx=True)
    assert await store.caexpire("lock:job", "wrong-owner", 30000) == 0
    assert await store.caexpire("lock:job", "client-42-uuid", 30000) == 1
    assert 29_900 <= await store.pttl("lock:job") <= 30_000


async def test_caexpire_example_watchdog(store: Store) -> None:
    """The spec's loop, its lease scaled down to 1.5 s (a third of it, 0.5 s, leaves a loaded
    machine's pauses a second of margin), renewing until the first lease is over."""
    assert await store.set("lock:job", "unique-token", px=1500, nx=True)
    await store.set("first-lease", "x", px=1500)  # set after the lock: it lapses after it
    while await store.pttl("first-lease") != -2:
        await asyncio.sleep(0.5)  # the watchdog's period, not a wait for an event
        assert await store.caexpire("lock:job", "unique-token", 1500) == 1
    assert await store.cad("lock:job", "unique-token") == 1
    assert await store.pttl("lock:job") == -2


# -- GOBLIN.CAS -----------------------------------------------------------------------------


async def test_cas_match_swaps_and_keeps_the_ttl(store: Store) -> None:
    assert await store.set("config", "v1", px=30000)
    assert await store.cas("config", "v1", "v2") is True
    assert await store.get("config") == b"v2"
    assert 29_000 < await store.pttl("config") <= 30_000  # still ticking


async def test_cas_match_on_a_key_without_ttl_keeps_none(store: Store) -> None:
    await store.set("counter:42", "v1")
    assert await store.cas("counter:42", "v1", "v2") is True
    assert await store.pttl("counter:42") == -1


async def test_cas_keeps_a_short_ttl_running(store: Store) -> None:
    await store.set("config", "v1", px=300)
    assert await store.cas("config", "v1", "v2") is True
    await asyncio.sleep(0.4)
    assert await store.get("config") is None  # the swap did not make it permanent


async def test_cas_mismatch_is_0_and_unchanged(store: Store) -> None:
    await store.set("counter:42", "v1", px=30000)
    assert await store.cas("counter:42", "v0", "v2") is False
    assert await store.get("counter:42") == b"v1"


async def test_cas_missing_key_is_not_created(store: Store) -> None:
    assert await store.cas("nothing", "", "v2") is False
    assert await store.cas("nothing", "v1", "v2") is False
    assert await store.pttl("nothing") == -2


async def test_cas_elapsed_key_is_not_recreated(store: Store) -> None:
    await store.set("config", "v1", px=200)
    await asyncio.sleep(0.3)
    assert await store.cas("config", "v1", "v2") is False
    assert await store.get("config") is None


@pytest.mark.parametrize("kind", ["hash", "zset"])
async def test_cas_non_string_is_wrongtype(backend: Backend, kind: str) -> None:
    await getattr(backend, f"make_{kind}")("config")
    await raises(backend.store.cas("config", "v1", "v2"), WRONGTYPE)


async def test_cas_new_that_cannot_fit_the_value_encoding(store: Store) -> None:
    store.max_value_bytes = 1024  # type: ignore[attr-defined]
    await store.set("config", "v1", px=30000)
    await raises(store.cas("config", "v1", b"x" * 1025), VALUE_TOO_LARGE)
    await raises(store.cas("config", "stale", b"x" * 1025), VALUE_TOO_LARGE)
    assert await store.get("config") == b"v1"
    assert await store.cas("config", "v1", b"x" * 1024) is True


async def test_cas_ten_megabyte_value(store: Store) -> None:
    big = bytes(range(256)) * (10 * 1024 * 1024 // 256)
    await store.set("blob", "v1", px=30000)
    set_at = time.monotonic()
    assert await store.cas("blob", "v1", big) is True
    assert await store.get("blob") == big
    assert await store.cas("blob", big, "v2") is True
    moved_ms = (time.monotonic() - set_at) * 1000  # 40 MB moved: slow on a loaded machine
    assert await store.pttl("blob") > 29_000 - moved_ms


async def test_cas_binary_and_byte_exact(store: Store) -> None:
    await store.set(BINARY_KEY, BINARY_VALUE)
    assert await store.cas(BINARY_KEY, BINARY_VALUE[:-1], b"x") is False
    assert await store.cas(BINARY_KEY, BINARY_VALUE + b"\x00", b"x") is False
    assert await store.cas(BINARY_KEY, BINARY_VALUE, b"\x00") is True
    assert await store.get(BINARY_KEY) == b"\x00"
    assert await store.cas(BINARY_KEY, b"\x00", b"") is True  # an empty value is a value
    assert await store.get(BINARY_KEY) == b""


async def test_cas_examples(store: Store) -> None:
    assert await store.set("counter:42", "v1")
    assert await store.cas("counter:42", "v0", "v2") is False  # stale expected value
    assert await store.cas("counter:42", "v1", "v2") is True
    assert await store.get("counter:42") == b"v2"
    # the TTL gotcha: a bare SET drops the expiry, CAS does not
    assert await store.set("config", "v1", px=30000)
    assert await store.cas("config", "v1", "v2") is True
    assert 29_000 < await store.pttl("config") <= 30_000
    assert await store.set("config", "v3")
    assert await store.pttl("config") == -1


async def test_cas_optimistic_update_loop(store: Store) -> None:
    await store.set("doc:1", "0")

    async def increment() -> None:
        while True:
            current = await store.get("doc:1")
            assert current is not None
            await asyncio.sleep(0)  # let the others race between read and swap
            if await store.cas("doc:1", current, str(int(current) + 1)):
                return

    await asyncio.gather(*(increment() for _ in range(20)))
    assert await store.get("doc:1") == b"20"


# -- GOBLIN.CAD -----------------------------------------------------------------------------


async def test_cad_example_transcript(store: Store) -> None:
    assert await store.set("lock:job", "client-42-uuid", px=30000, nx=True)
    assert await store.cad("lock:job", "someone-else") == 0  # not my token: the lock stays
    assert await store.get("lock:job") == b"client-42-uuid"
    assert await store.cad("lock:job", "client-42-uuid") == 1  # released
    assert await store.pttl("lock:job") == -2
    assert await store.cad("lock:job", "client-42-uuid") == 0  # already gone


async def test_cad_elapsed_key(store: Store) -> None:
    await store.set("lock:job", "tok", px=200)
    await asyncio.sleep(0.3)
    assert await store.cad("lock:job", "tok") == 0


@pytest.mark.parametrize("kind", ["hash", "zset"])
async def test_cad_non_string_is_wrongtype(backend: Backend, kind: str) -> None:
    await getattr(backend, f"make_{kind}")("lock:job")
    await raises(backend.store.cad("lock:job", "tok"), WRONGTYPE)


async def test_cad_binary_and_byte_exact(store: Store) -> None:
    await store.set(BINARY_KEY, BINARY_VALUE)
    assert await store.cad(BINARY_KEY, BINARY_VALUE.upper()) == 0
    assert await store.cad(BINARY_KEY, BINARY_VALUE.rstrip(b"\x00")) == 0
    assert await store.cad(BINARY_KEY, BINARY_VALUE) == 1
    await store.set("", "")
    assert await store.cad("", "") == 1


# -- arguments that are not keys ------------------------------------------------------------


@pytest.mark.parametrize("bad", [1, 1.5, None, ["k"], object()])
async def test_keys_and_values_must_be_str_or_bytes(store: Store, bad: object) -> None:
    with pytest.raises(TypeError):
        await store.claim(bad, "r", "t", 30)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await store.claim("c", "r", bad, 30)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await store.caexpire("k", bad, 30)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await store.cas("k", "v", bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await store.cad(bad, "v")  # type: ignore[arg-type]
    assert await store.pttl("c") == -2
