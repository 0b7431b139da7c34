"""`python -m example_app.worker_demo [--messages N]`: a stream consumer killed mid-event.

Needs ``REDIS_URL``. It adds N payment events to a fresh stream, starts a worker
(``python -m example_app.worker``), kills it with SIGKILL while it is charging events, starts
a second worker that reclaims the dead worker's pending messages (XAUTOCLAIM), waits until
every message is acknowledged, and reads the ledger: one charge per event, whatever was
delivered twice. Leases are 2 s and messages are reclaimed after 1 s idle, so it takes a
few seconds. Each run uses a fresh stream and account, so it can be repeated.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from goblin_idem import RedisStore

from .ledger import ledger_view
from .worker import publish_events, sample_events

__all__ = ["StreamDemo", "main", "run_stream_demo"]

LEASE_SECONDS = 2
RECLAIM_IDLE_MS = 1000


@dataclass
class StreamDemo:
    messages: int
    account: str
    killed_mid_event: int = 0  # events the killed worker had started and not charged
    deliveries: int = 0  # messages handed to a consumer, redeliveries included
    redeliveries: int = 0  # messages reclaimed from the dead consumer (XAUTOCLAIM)
    runs: int = 0  # times the handler started (a killed run included)
    acked: int = 0
    effects: int = 0  # payments in the ledger
    duplicate_charges: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"messages={self.messages} deliveries={self.deliveries} "
            f"redeliveries={self.redeliveries} killed_mid_event={self.killed_mid_event} "
            f"runs={self.runs} acked={self.acked} effects={self.effects} "
            f"duplicate_charges={len(self.duplicate_charges)} in {self.seconds:.1f}s"
        )


class _Worker:
    """A `python -m example_app.worker` process whose log lines are read as they come."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, url: str, stream: str, group: str, name: str) -> _Worker:
        env = {**os.environ, "REDIS_URL": url, "GOBLIN_LEASE_SECONDS": str(LEASE_SECONDS)}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "example_app.worker",
            "--stream",
            stream,
            "--group",
            group,
            "--consumer",
            name,
            "--batch",
            "5",
            "--reclaim-idle-ms",
            str(RECLAIM_IDLE_MS),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        return cls(proc)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            self.lines.append(line.decode().rstrip())

    def count(self, word: str) -> int:
        return sum(1 for line in self.lines if line.split(" ")[1:2] == [word])

    def events(self, word: str) -> set[str]:
        return {line.split(" ")[2] for line in self.lines if line.split(" ")[1:2] == [word]}

    async def stop(self, sig: int) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        await self.reader


async def run_stream_demo(url: str, messages: int = 20, *, work_ms: int = 300) -> StreamDemo:
    """The scenario of the module docstring; the figures, as the logs and the ledger show them."""
    t0 = time.monotonic()
    run = secrets.token_hex(4)
    stream, group, account = f"demo:{run}:events", "ledger", f"acct_{run}"
    demo = StreamDemo(messages, account)
    store = RedisStore.from_url(url)
    first = second = None
    try:
        await publish_events(
            store, sample_events(account, messages, prefix=f"evt_{run}", work_ms=work_ms), stream
        )
        first = await _Worker.start(url, stream, group, "worker-a")
        # Kill it while it charges: once it has started a third of the events.
        await _until(
            lambda: first is not None and first.count("started") >= max(1, messages // 3), 30
        )
        await first.stop(signal.SIGKILL)
        demo.killed_mid_event = len(first.events("started") - first.events("charged"))
        second = await _Worker.start(url, stream, group, "worker-b")
        client: Any = store.client

        async def drained() -> bool:
            info = {g["name"]: g for g in await client.xinfo_groups(stream)}[group.encode()]
            last = await client.xrevrange(stream, count=1)
            return bool(info["pending"] == 0 and info["last-delivered-id"] == last[0][0])

        await _until_async(drained, 60)
        await second.stop(signal.SIGTERM)
        workers = (first, second)
        demo.deliveries = sum(w.count("received") + w.count("reclaimed") for w in workers)
        demo.redeliveries = second.count("reclaimed")
        demo.runs = sum(w.count("started") for w in workers)
        demo.acked = sum(w.count("acked") for w in workers)
        ledger = await ledger_view(store, account)
        demo.effects = ledger["accounts"].get(account, {}).get("payments", 0)
        demo.duplicate_charges = ledger["duplicate_charges"]
    finally:
        for worker in (first, second):
            if worker is not None:
                await worker.stop(signal.SIGKILL)
        await store.aclose()
    demo.seconds = time.monotonic() - t0
    return demo


async def _until(condition: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the demo did not reach its next step in time")
        await asyncio.sleep(0.01)


async def _until_async(condition: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the workers did not acknowledge every message in time")
        await asyncio.sleep(0.05)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m example_app.worker_demo")
    parser.add_argument("--messages", type=int, default=20, help="events to publish (20)")
    parser.add_argument("--work-ms", type=int, default=300, help="each event's work (300)")
    args = parser.parse_args(argv)
    url = os.environ.get("REDIS_URL")
    if not url:
        print("set REDIS_URL to a Redis or Valkey server the demo may write to", file=sys.stderr)
        return 2
    demo = asyncio.run(run_stream_demo(url, args.messages, work_ms=args.work_ms))
    print(demo.summary())
    ok = demo.effects == demo.messages and not demo.duplicate_charges
    print("ledger: one charge per event" if ok else "ledger: WRONG number of charges")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
