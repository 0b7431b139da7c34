"""Keys for the calls a claimed run makes to other APIs, derived from the run's claim.

A run that runs twice (its worker paused past its lease, its claim lost with the store, a
first run that failed after its downstream call) must send the next API the same keys both
times, or that API does the work twice. So an outgoing key is not drawn at random inside a
run: it is a keyed hash of what both runs share, and of nothing else:

- the run's claim key name (``<ns>:{<hash>}:c``, `_keys.key_names`), whole: the namespace
  in clear as its prefix (the hash covers only the scope and the key, so two namespaces
  with one scope and key differ by the prefix alone) and the hash of scope and key; the
  same in every process and on every re-run;
- the call's name: a `label` the caller gives it, and for the httpx transports its method
  and URL with it. Nothing else a run sees tells one call from another: a call's position
  among the run's calls changes when a re-run skips a conditional call (a fee the first run
  paid) or when concurrent calls reach the transport in another order, and its body may
  hold what changes between runs (a timestamp). So a call the transports would key inside
  a run must be labelled (`client._call` refuses one that is not);
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

__all__ = ["call_key", "derive", "label_key", "secret_bytes"]

# The HMAC key when the app gives no secret: a fixed domain separator, so a derived key is
# never the plain hash of anything else this library computes.
_DEFAULT_SECRET = b"goblin-idem derived key v1"
_LABEL = b"L"  # what follows is the name a caller gave the key


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


def call_key(claim_name: bytes, secret: bytes, method: str, url: str, label: str) -> str:
    """The key of an outgoing HTTP call named `label` by the run that holds `claim_name`.

    The same (method, URL, label) is the same call, so a handler that repeats it (its own
    retry) sends the same key, and a re-run sends it whatever it did before or around it.
    """
    fields = (method.upper().encode(), _text(url, "a URL"), _LABEL)
    return derive(claim_name, secret, *fields, _text(label, "the idempotency_label extension"))


def _field(value: bytes) -> bytes:
    return len(value).to_bytes(4, "big") + value  # (a, bc) and (ab, c) differ


def _text(value: object, what: str) -> bytes:
    if not isinstance(value, str) or not value:
        raise TypeError(f"{what} must be a non-empty str, not {value!r}")
    return value.encode()
