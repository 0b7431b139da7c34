"""Sealing stored bytes at rest (AES-256-GCM under a key ring), for an application's own
values: the public names of `goblin_idem.records`' sealing, where the format and its
guarantees are stated.

`keys_from_env()` parses ``$GOBLIN_IDEM_ENCRYPTION_KEYS`` as the middleware does, and
`Sealer(keys)` seals and opens values bound to the name they are stored under.
"""

from .exceptions import SealError
from .records._sealing import ENV_VAR, KEY_BYTES, Sealer, key_id, keys_from_env

__all__ = ["ENV_VAR", "KEY_BYTES", "SealError", "Sealer", "key_id", "keys_from_env"]
