"""Compression of stored bodies: zlib (standard library) or zstd (Python 3.14's
`compression.zstd`, or the `zstandard` package), named in the record by a codec byte.

A reader decompresses to exactly the length the record states and no further, so a record
cannot expand past the size it was written at. A codec this process cannot run (zstd
without either module) is an unreadable record, answered 503 and never re-run: a fleet
that shares a store should write zstd only once every process can read it.
"""

from __future__ import annotations

import importlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["IDENTITY", "ZLIB", "ZSTD", "Compressor", "compressor", "decompress"]

IDENTITY = 0
ZLIB = 1
ZSTD = 2
ZLIB_LEVEL = 6  # zlib's own default: about 4x on JSON at about 10 ms per MiB here
ZSTD_LEVEL = 3  # zstd's own default


@dataclass(frozen=True, slots=True)
class Compressor:
    """A body compression the record names by `id` (its codec byte)."""

    id: int
    compress: Callable[[bytes], bytes]


def _zstd() -> Any:
    """The zstd module of this interpreter (3.14+) or the zstandard package, or None."""
    for name in ("compression.zstd", "zstandard"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def _is_zstandard(module: Any) -> bool:
    """The zstandard package (3.14's compression.zstd has CompressionParameter instead)."""
    return not hasattr(module, "CompressionParameter")


def compressor(name: str) -> Compressor:
    if name == "zlib":
        return Compressor(ZLIB, lambda data: zlib.compress(data, ZLIB_LEVEL))
    if name == "zstd":
        module = _zstd()
        if module is None:
            raise RuntimeError(
                "compression='zstd' needs Python 3.14 or the zstandard package "
                "(pip install zstandard); or use compression='zlib'"
            )
        if _is_zstandard(module):
            return Compressor(ZSTD, module.ZstdCompressor(level=ZSTD_LEVEL).compress)
        return Compressor(ZSTD, lambda data: module.compress(data, level=ZSTD_LEVEL))
    raise ValueError(f"compression must be 'zlib', 'zstd' or None, not {name!r}")


def decompress(codec_id: int, data: bytes, size: int) -> bytes:
    """`size` bytes out of `data`; ValueError if it does not hold exactly that."""
    if codec_id == ZLIB:
        d = zlib.decompressobj()
        try:
            out = d.decompress(data, size)
            ended = d.eof and not d.unconsumed_tail
        except zlib.error as exc:
            raise ValueError(f"zlib: {exc}") from None
    elif codec_id == ZSTD:
        module = _zstd()
        if module is None:
            raise ValueError(
                "zstd-compressed, and this process has neither Python 3.14's compression.zstd "
                "nor the zstandard package"
            )
        try:
            if _is_zstandard(module):
                out = module.ZstdDecompressor().decompress(data, max_output_size=size)
            else:
                out = module.ZstdDecompressor().decompress(data, max_length=size)
        except Exception as exc:  # each module has its own error type
            raise ValueError(f"zstd: {exc}") from None
        ended = True
    else:
        raise ValueError(f"unknown codec {codec_id}")
    if len(out) != size or not ended:
        raise ValueError(f"does not decompress to the stated {size} bytes")
    return bytes(out)
