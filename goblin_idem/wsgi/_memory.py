"""Replays from the replay cache, answered in the request's thread.

A duplicate of a key whose result the loop thread's shared connection keeps in its replay
cache (``RedisStore(replay_cache_bytes=...)``, store/_replay_cache.py) costs the ASGI
middleware no round trip; through the bridge it still costs the hand-over to the loop
thread and back, and the loop thread's run of the middleware: more than a Django view.
Here the request's thread does what the middleware would do for it, in the same order: the
key checked, the route's settings, the key names and fingerprint (`Identity.identify`), the
cache's entry, then the record read and checked by the middleware's own `Answers.replay`,
its event reported and its start message made by `replay_start`. So the answer is the one
the middleware would send, byte for byte, and it is counted and told to `on_event` as one
(with ``otel``, on the span current in the request's thread; no store call is timed, since
none is made).

Only the plainest case is taken: a claim step that asks the store alone (no records, no
waiting, no 0.1.0 names) and a record that replays as it stands. Anything else (no entry,
another request under the key, an unreadable record, a webhook route, a key the middleware
refuses) returns None, and the request takes the bridged path, which answers it as before
and fills the cache.

The cache is read as the loop thread reads it, under the same conditions, from this thread
(`AutoPipeline.cached` with `time.monotonic()`, which says why that is safe).
"""

from __future__ import annotations

import time

from starlette.types import Message, Scope

from .._keys import header_key, valid_key
from .._routes import Settings
from .._threads._loop import started_loop
from ..middleware import IdempotencyMiddleware as ASGIIdempotencyMiddleware
from ..middleware._responses import replay_start
from ..store import RedisStore
from ..store._autopipeline import AutoPipeline

__all__ = ["MemoryReplays"]


class MemoryReplays:
    """The replays of one adapter's middleware (`core`) that its thread answers itself."""

    __slots__ = ("core", "store")

    def __init__(self, core: ASGIIdempotencyMiddleware, store: RedisStore) -> None:
        self.core = core
        self.store = store

    @classmethod
    def of(cls, core: ASGIIdempotencyMiddleware) -> MemoryReplays | None:
        """For a middleware whose store keeps a replay cache and whose claim step asks the
        store alone; else None (every replay is the middleware's)."""
        store = core.store
        if not isinstance(store, RedisStore) or not store.replay_cache_bytes:
            return None
        return cls(core, store) if core.claim_step.plain else None

    def answer(
        self, scope: Scope, settings: Settings, key: str, body: bytes
    ) -> tuple[Message, bytes] | None:
        """The replay's start message and body, its event reported; None to take the
        bridged path. `settings` are the request's (`Routes.covering`), `key` the header's
        value as the environ holds it."""
        core = self.core
        raw = key.encode("latin-1")
        checked = header_key(raw)
        if checked is None or not valid_key(checked, core.key_pattern):
            return None
        if settings.webhook is not None:
            return None
        names, fp = core.identity.identify(scope, checked, body)
        data = self._kept(names.result)
        if data is None:
            return None
        record = core.answers.replay(data, fp, names)
        if record is None:
            return None
        core.answers.report("replayed", names.hash)
        return replay_start(record), record.body

    def _kept(self, result_key: bytes) -> bytes | None:
        """The result kept by the loop thread's connection, on the conditions under which
        the loop thread would serve it (`AutoPipeline.cached`, read from this thread)."""
        loop = started_loop()
        executor = None if loop is None else self.store._loops.get(loop)
        pipeline = None if executor is None else executor.replays
        if not isinstance(pipeline, AutoPipeline):
            return None  # none, or a cluster's: the loop thread looks it up
        return pipeline.cached(result_key, time.monotonic())
