"""What is stored for a completed request: the record format, its body compression, and
sealing at rest.

- `_format`: the versioned binary record and the request fingerprint.
- `_compression`: zlib or zstd bodies, named by a codec byte.
- `_sealing`: AES-256-GCM under a key ring (public as `goblin_idem.sealing`).
"""

from ..exceptions import RecordError, SealError
from ._format import Record, decode, encode, fingerprint

__all__ = ["Record", "RecordError", "SealError", "decode", "encode", "fingerprint"]
