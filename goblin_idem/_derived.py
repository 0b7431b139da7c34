"""Keys for the calls a claimed run makes to other APIs, derived from the run's claim.

A run that runs twice (its worker paused past its lease, its claim lost with the store, a
first run that failed after its downstream call) must send the next API the same keys both
times, or that API does the work twice. So an outgoing key is not drawn at random inside a
run: it is a keyed hash of what both runs share, and of nothing else:

- the run's claim key name (``<ns>:{<hash>}:c``): its hash already covers the namespace,
  the scope and the key (`_keys.key_names`), the same in every process and on every re-run;
- the call: a `label` the caller names it by, or, for the httpx transports, its method and
  URL plus its label or its ordinal among the run's unlabelled calls to that method and URL;
- an app's own `secret`, if it gives one (none is needed).

HMAC-SHA256 over length-prefixed fields, so two different tuples never feed the same bytes;
the output is 122 bits of the MAC written as an RFC 9562 version 8 UUID (``8`` as the version
digit, the variant bits ``10``): a valid ``Idempotency-Key`` everywhere (36 characters, what
APIs that insist on a UUID accept), and nothing of the run's key, scope or key hash can be
read back from it. Without a secret, anyone who knows a run's key and scope can compute its
derived keys: the client that sent the key, which could send the downstream calls itself.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import threading
import weakref

from ._lease import Lease

__all__ = ["call_key", "derive", "label_key", "secret_bytes"]

# The HMAC key when the app gives no secret: a fixed domain separator, so a derived key is
# never the plain hash of anything else this library computes.
_DEFAULT_SECRET = b"goblin-idem derived key v1"
_LABEL = b"L"  # a call named by its label
_ORDINAL = b"N"  # the n-th unlabelled call to a method and URL


def secret_bytes(secret: bytes | str | None) -> bytes:
    """The HMAC key for `secret` (None: the default), checked: a wrong one says what to pass."""
    if secret is None:
        return _DEFAULT_SECRET
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes):
        raise TypeError(f"a key secret must be bytes or str, not {type(secret).__name__}")
    if not secret:
        raise ValueError("a key secret must not be empty (pass None for no secret of your own)")
    return secret


def derive(claim_name: bytes, secret: bytes, *fields: bytes) -> str:
    """The derived key of `fields` in the run that holds `claim_name`: a version 8 UUID."""
    mac = hmac.new(secret, _field(claim_name), hashlib.sha256)
    for field in fields:
        mac.update(_field(field))
    raw = bytearray(mac.digest()[:16])
    raw[6] = 0x80 | (raw[6] & 0x0F)  # version 8: custom (RFC 9562 section 5.8)
    raw[8] = 0x80 | (raw[8] & 0x3F)  # variant 10
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def label_key(claim_name: bytes, secret: bytes, label: str) -> str:
    """`Claim.derive_key`: the key a run names `label`, the same however often it asks."""
    return derive(claim_name, secret, _LABEL, _text(label, "derive_key's label"))


def call_key(lease: Lease, secret: bytes, method: str, url: str, label: str | None) -> str:
    """The key of an outgoing HTTP call of the run that holds `lease`.

    A labelled call is named by (method, URL, label): the same label is the same call, so a
    handler that repeats it (its own retry) sends the same key. An unlabelled call is the
    n-th to its method and URL in this run, counted from 1: a re-run that makes the same
    calls in the same order sends the same keys, and a second, different call to the same
    URL gets a key of its own instead of the first one's answer.
    """
    fields = [method.upper().encode(), _text(url, "a URL")]
    if label is not None:
        fields += [_LABEL, _text(label, "the idempotency_label extension")]
    else:
        fields += [_ORDINAL, str(_ordinal(lease, fields[0], fields[1])).encode()]
    return derive(lease.key, secret, *fields)


# Each run's count of unlabelled calls per (method, URL), kept while its lease is: the lease
# is the one object every holder of a run's claim shares (the middleware's responder, `once`,
# the claim as sync code sees it), and a re-run has a new one, so it counts from 1 again.
_counts: weakref.WeakKeyDictionary[Lease, dict[tuple[bytes, bytes], itertools.count[int]]] = (
    weakref.WeakKeyDictionary()
)
_counts_lock = threading.Lock()  # sync code may call from several threads of one run


def _ordinal(lease: Lease, method: bytes, url: bytes) -> int:
    with _counts_lock:
        counts = _counts.setdefault(lease, {})
        counter = counts.setdefault((method, url), itertools.count(1))
        return next(counter)


def _field(value: bytes) -> bytes:
    return len(value).to_bytes(4, "big") + value  # (a, bc) and (ab, c) differ


def _text(value: object, what: str) -> bytes:
    if not isinstance(value, str) or not value:
        raise TypeError(f"{what} must be a non-empty str, not {value!r}")
    return value.encode()
