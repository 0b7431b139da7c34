"""How the test apps count their runs: in the store's server (``runs:<key>``, so that every
worker process counts in one place) when REDIS_URL is set, else in the process."""

from __future__ import annotations

import collections
import os
import threading

import redis

_url = os.environ.get("REDIS_URL")
_client = redis.Redis.from_url(_url) if _url else None
_local: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()


def note(name: str, value: object) -> None:
    """Write `value` under `name` where the test can read it (the store's server)."""
    if _client is not None:
        _client.set(name, str(value))


def count(key: str) -> int:
    """This run of `key`'s work: 1 for its first run, 2 for a second."""
    if _client is not None:
        return int(_client.incr(f"runs:{key}"))
    with _lock:
        _local[key] += 1
        return _local[key]
