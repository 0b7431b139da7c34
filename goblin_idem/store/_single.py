"""The executors of a single server: over the connection every concurrent caller shares
(`Pipelined`, the default), or through redis-py's client and pool (`Direct`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio

from . import _scripts as scripts
from ._autopipeline import AutoPipeline
from ._executor import NOT_WAITED, Acked, Command, Executor, Where, no_script
from ._redis_compat import drop_pool

__all__ = ["Direct", "Pipelined"]


class Direct(Executor):
    """A single server through the redis-py client: one command as a call of its own,
    several as a pipeline (not a transaction: a MULTI among them makes one)."""

    client: redis.asyncio.Redis


class Pipelined(Executor):
    """A single server over the connection every concurrent caller shares (`AutoPipeline`);
    never with WAIT, which would block it for everyone."""

    client: redis.asyncio.Redis

    def __init__(self, client: redis.asyncio.Redis, pipeline: AutoPipeline) -> None:
        super().__init__(client, None)
        self.pipeline = self.shared = pipeline
        if pipeline.replay_cache_bytes:
            self.replays = pipeline

    async def send(self, key: bytes, commands: Sequence[Command]) -> list[Any]:
        # The hot path, with no coroutine between the store's and the pipeline's own.
        replies = await self.pipeline.execute(commands)
        if no_script(replies):
            return await self._again(key, commands, None)
        return replies

    async def send_durably(
        self, key: bytes, commands: Sequence[Command]
    ) -> tuple[list[Any], Acked]:
        replies = await self.pipeline.execute(commands)
        if no_script(replies):
            replies = await self._again(key, commands, None)
        return replies, NOT_WAITED

    async def _send(self, key: bytes, commands: Sequence[Command]) -> tuple[list[Any], Where]:
        return await self.pipeline.execute(commands), None

    async def _each(self, commands: Sequence[Command]) -> list[Any]:
        return await self.pipeline.execute(commands)

    async def _load_scripts(self, key: bytes | None, where: Where) -> None:
        # on the connection that met NOSCRIPT, which is surely up
        loaded = await self.pipeline.execute([("SCRIPT", "LOAD", s.body) for s in scripts.ALL])
        for reply in loaded:
            if isinstance(reply, Exception):
                raise reply

    def forget(self) -> list[object]:
        return [*self.pipeline.forget(), *drop_pool(self.client)]

    async def aclose(self) -> None:
        await self.pipeline.aclose()
