"""Sealing stored bytes at rest: AES-256-GCM under a key ring, bound to where they are stored.

A sealed value, as stored::

    key_id:4 salt:16 ciphertext tag:16

- `key_id` (in the clear) names the ring key that sealed it: the first 4 bytes of a keyed
  BLAKE2b of nothing under that key, so it says which key to try and reveals nothing of it.
- `salt` is fresh randomness per value; the value is sealed under its own key, BLAKE2b of the
  salt keyed by the ring key. A ring key may then seal any number of values: random 96-bit
  GCM nonces under one key allow about 2^32 (50 days at 1,000 keys a second), 128-bit salts
  about 2^64. Each derived key seals one value, so the GCM nonce is a constant.
- `associated_data` (the store key name, for a response) is authenticated, not stored: a
  value copied under another name, or altered by one bit, does not open.

The first key of the ring seals; every key opens, so keys rotate without a flag day
(docs/operating/encryption.md). `cryptography` is imported only when a Sealer is built.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import secrets
from collections.abc import Sequence
from typing import Any

from ..exceptions import SealError

__all__ = ["ENV_VAR", "KEY_BYTES", "SealError", "Sealer", "key_id", "keys_from_env"]

#: The environment variable `keys_from_env` reads by default.
ENV_VAR = "GOBLIN_IDEM_ENCRYPTION_KEYS"
KEY_BYTES = 32
KEY_ID_BYTES = 4
SALT_BYTES = 16
TAG_BYTES = 16
OVERHEAD = KEY_ID_BYTES + SALT_BYTES + TAG_BYTES
_NONCE = bytes(12)  # each derived key seals exactly one value
_KID_PERSON = b"goblin-idem kid"
_SEAL_PERSON = b"goblin-idem seal"


def key_id(key: bytes) -> bytes:
    """The 4-byte id a value sealed under `key` carries in the clear."""
    return hashlib.blake2b(b"", key=key, digest_size=KEY_ID_BYTES, person=_KID_PERSON).digest()


def _check_keys(keys: object) -> list[bytes]:
    if isinstance(keys, (bytes, bytearray, str)) or not isinstance(keys, Sequence):
        raise TypeError(
            "encryption keys must be a list of 32-byte keys, current first: "
            "[current, *older] (one key: [key])"
        )
    if not keys:
        raise ValueError("encryption keys must hold at least one 32-byte key (the current one)")
    ring = []
    for i, key in enumerate(keys):
        if not isinstance(key, (bytes, bytearray)):
            raise TypeError(
                f"encryption key {i} must be bytes (32 random bytes, e.g. os.urandom(32)), "
                f"not {type(key).__name__}"
            )
        if len(key) != KEY_BYTES:
            raise ValueError(
                f"encryption key {i} must be {KEY_BYTES} bytes, not {len(key)}: make one with "
                "os.urandom(32)"
            )
        ring.append(bytes(key))
    if len({key_id(k) for k in ring}) != len(ring):
        raise ValueError("an encryption key is listed twice: list each key once, current first")
    return ring


class Sealer:
    """seal(plaintext, associated_data) -> bytes and open(sealed, associated_data) -> bytes
    under a key ring: the first key seals, every key opens."""

    __slots__ = ("_aead", "_invalid", "_keys", "key_ids")

    def __init__(self, keys: Sequence[bytes]) -> None:
        ring = _check_keys(keys)
        try:
            from cryptography.exceptions import InvalidTag
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError:
            raise RuntimeError(
                "encryption at rest needs the cryptography package: "
                "pip install 'goblin-idem[crypto]'"
            ) from None
        self._aead: Any = AESGCM
        self._invalid: type[Exception] = InvalidTag
        self._keys = {key_id(k): k for k in ring}
        #: The ids of the ring's keys, the sealing one first.
        self.key_ids: tuple[bytes, ...] = tuple(self._keys)

    def __repr__(self) -> str:  # never the keys themselves
        return f"Sealer(key_ids=[{', '.join(k.hex() for k in self.key_ids)}])"

    def _derived(self, key: bytes, salt: bytes) -> Any:
        subkey = hashlib.blake2b(salt, key=key, digest_size=KEY_BYTES, person=_SEAL_PERSON)
        return self._aead(subkey.digest())

    def seal(self, plaintext: bytes, associated_data: bytes) -> bytes:
        kid = self.key_ids[0]
        salt = secrets.token_bytes(SALT_BYTES)
        sealed: bytes = self._derived(self._keys[kid], salt).encrypt(
            _NONCE, plaintext, associated_data
        )
        return kid + salt + sealed

    def open(self, sealed: bytes, associated_data: bytes) -> bytes:
        if len(sealed) < OVERHEAD:
            raise SealError(
                f"truncated: {len(sealed)} bytes, less than a sealed value's {OVERHEAD}"
            )
        kid = bytes(sealed[:KEY_ID_BYTES])
        key = self._keys.get(kid)
        if key is None:
            raise SealError(
                f"sealed with key id {kid.hex()}, which is not among the configured keys "
                f"({', '.join(k.hex() for k in self.key_ids)})"
            )
        salt = sealed[KEY_ID_BYTES : KEY_ID_BYTES + SALT_BYTES]
        try:
            return bytes(
                self._derived(key, salt).decrypt(
                    _NONCE, sealed[KEY_ID_BYTES + SALT_BYTES :], associated_data
                )
            )
        except self._invalid:
            raise SealError(
                f"does not open under key id {kid.hex()}: altered, or stored under another "
                "name than the one it was sealed for"
            ) from None


def sealed_key_id(sealed: bytes) -> bytes:
    """The key id a sealed value names (no key needed)."""
    return bytes(sealed[:KEY_ID_BYTES])


def keys_from_env(name: str = ENV_VAR, environ: Any = None) -> list[bytes] | None:
    """The keys in environment variable `name`: comma-separated base64 (standard or
    URL-safe alphabet) of 32 bytes each, current first; None if it is unset or empty.
    docs/operating/encryption.md shows how to make a key. An error names the position of a
    bad key, never its text."""
    value = (os.environ if environ is None else environ).get(name, "")
    if not value.strip():
        return None
    keys = []
    for i, text in enumerate(value.split(",")):
        text = text.strip()
        try:
            key = base64.b64decode(text.replace("-", "+").replace("_", "/"), validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(
                f"${name}: key {i} is not base64; give comma-separated base64 keys of 32 bytes "
                "each (44 characters), current first"
            ) from None
        if len(key) != KEY_BYTES:
            raise ValueError(
                f"${name}: key {i} is {len(key)} bytes, not {KEY_BYTES}; give comma-separated "
                "base64 keys of 32 bytes each (44 characters), current first"
            )
        keys.append(key)
    return keys
