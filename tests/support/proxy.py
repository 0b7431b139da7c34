"""A loopback TCP proxy for the reliability suite: latency, stalls, resets and partitions.

It runs its own asyncio loop in a daemon thread, so the load it carries (an app in the test's
loop, or a replica's replication link) does not share a loop with the faults it injects. It
listens on a free 127.0.0.1 port and forwards to one target. Faults:

- ``latency``: a (low, high) delay in seconds added to every chunk, each direction, order kept;
- ``stall(seconds, fraction, new=False)``: a random `fraction` of the open connections stop
  forwarding (with ``new=True``, connections opened meanwhile too);
- ``reset(fraction)``: a random `fraction` of the open connections are closed with a TCP RST;
- ``partition()``: every open connection is dropped, with whatever it had queued, and new
  ones are refused until ``heal()``;
- ``cut_after(marker)``: the connection whose client sends `marker` next forwards its bytes
  up to the end of `marker` and no further, then ends (the server reads those bytes, then
  the end of the stream; the client sees the connection close), and new connections are
  refused until ``heal()``: a client cut off between two commands it sent in one write;
- ``drop_responses(n)``: the next `n` answers are lost: when the server's first bytes of
  one arrive, the connection is reset on both sides instead of forwarding them, so the
  request was received and processed but the client never hears back;
- ``replication_delay``: an extra delay on the server-to-client direction of connections whose
  client spoke ``PSYNC`` (a Redis replica's link to its primary), so a replica behind the
  proxy lags its primary by that much while ordinary clients do not.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

CHUNK = 65536


@dataclass
class ProxyStats:
    connections: int = 0
    refused: int = 0
    resets: int = 0
    stalls: int = 0
    dropped_bytes: int = 0  # queued when a partition or reset dropped the connection
    forwarded_bytes: int = 0
    dropped_responses: int = 0


@dataclass(eq=False)
class _Conn:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    replication: bool = False
    stalled_until: float = 0.0
    queues: list[deque[tuple[float, bytes]]] = field(default_factory=lambda: [deque(), deque()])
    ready: list[asyncio.Event] = field(default_factory=lambda: [asyncio.Event(), asyncio.Event()])
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    closed: bool = False
    sent_tail: bytes = b""  # the last client bytes, for a `cut_after` marker split over reads


def resp_args(*args: bytes | str | int) -> bytes:
    """Command arguments as they travel on the wire (RESP bulk strings), e.g. the last
    arguments of a command as a `cut_after` marker."""
    out = []
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class Proxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1", seed: int = 0) -> None:
        self.target = (target_host, target_port)
        self.latency: tuple[float, float] = (0.0, 0.0)
        self.replication_delay = 0.0
        self.stats = ProxyStats()
        self.port = 0
        self._rng = random.Random(seed)
        self._refusing = False
        self._stall_new_until = 0.0
        self._cut_marker = b""
        self.cuts = 0
        self._drop_responses = 0
        self._conns: set[_Conn] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    # -- life cycle (called from any thread) --

    def start(self) -> Proxy:
        self._thread.start()
        self._call(self._start())
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _call(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- faults (called from any thread) --

    def stall(self, seconds: float, fraction: float = 1.0, *, new: bool = False) -> int:
        """Stop forwarding on a random `fraction` of the open connections for `seconds`
        (and, with `new`, on every connection opened within those seconds)."""
        if new:
            self._stall_new_until = max(self._stall_new_until, time.monotonic() + seconds)
        return int(self._call(self._stall(seconds, fraction)))

    def reset(self, fraction: float = 1.0) -> int:
        """Close a random `fraction` of the open connections with a TCP RST, both sides."""
        return int(self._call(self._reset(fraction)))

    def partition(self) -> int:
        """Drop every connection with what it had queued, and refuse new ones."""
        self._refusing = True
        return int(self._call(self._reset(1.0)))

    def cut_after(self, marker: bytes) -> None:
        """Cut the next connection whose client sends `marker` right after it (see above)."""
        if not marker:
            raise ValueError("cut_after needs a non-empty marker")
        self._cut_marker = marker

    def heal(self) -> None:
        self._refusing = False
        self._cut_marker = b""

    def drop_responses(self, n: int) -> None:
        """Lose the next `n` server answers (each resets its connection)."""
        self._call(self._set_drop(n))

    def open_connections(self) -> int:
        return len(self._conns)

    # -- the loop side --

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._reset(1.0, count=False)

    async def _set_drop(self, n: int) -> None:
        self._drop_responses = n

    async def _stall(self, seconds: float, fraction: float) -> int:
        chosen = [c for c in list(self._conns) if self._rng.random() < fraction]
        until = time.monotonic() + seconds
        for conn in chosen:
            conn.stalled_until = max(conn.stalled_until, until)
        self.stats.stalls += len(chosen)
        return len(chosen)

    async def _reset(self, fraction: float, count: bool = True) -> int:
        chosen = [c for c in list(self._conns) if self._rng.random() < fraction]
        for conn in chosen:
            self._abort(conn, count=count)
        return len(chosen)

    def _abort(self, conn: _Conn, count: bool = True) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.discard(conn)
        if count:
            self.stats.resets += 1
        self.stats.dropped_bytes += sum(len(d) for q in conn.queues for _, d in q)
        for writer in (conn.client, conn.server):
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        for task in conn.tasks:
            if task is not asyncio.current_task():
                task.cancel()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing:
            self.stats.refused += 1
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            self.stats.refused += 1
            writer.transport.abort()
            return
        self.stats.connections += 1
        conn = _Conn(writer, up_writer, stalled_until=self._stall_new_until)
        self._conns.add(conn)
        conn.tasks = [
            asyncio.ensure_future(self._read(conn, reader, 0)),
            asyncio.ensure_future(self._write(conn, up_writer, 0)),
            asyncio.ensure_future(self._read(conn, up_reader, 1)),
            asyncio.ensure_future(self._write(conn, writer, 1)),
        ]

    async def _read(self, conn: _Conn, reader: asyncio.StreamReader, direction: int) -> None:
        """Direction 0 is client to server, 1 is server to client."""
        queue = conn.queues[direction]
        last = 0.0
        try:
            while not conn.closed:
                data = await reader.read(CHUNK)
                if not data:
                    break
                if direction == 1 and self._drop_responses > 0:
                    self._drop_responses -= 1
                    self.stats.dropped_responses += 1
                    self._abort(conn, count=False)
                    return
                if direction == 0 and not conn.replication and b"PSYNC" in data.upper():
                    conn.replication = True
                cut = self._cut_at(conn, data) if direction == 0 else 0
                if cut:
                    data = data[:cut]
                delay = self._rng.uniform(*self.latency) if self.latency[1] > 0 else 0.0
                if direction == 1 and conn.replication:
                    delay += self.replication_delay
                last = max(last, time.monotonic() + delay)
                queue.append((last, data))
                conn.ready[direction].set()
                if cut:
                    break
        except (OSError, asyncio.CancelledError):
            pass
        queue.append((last, b""))  # end of stream
        conn.ready[direction].set()

    def _cut_at(self, conn: _Conn, data: bytes) -> int:
        """How many bytes of `data` to forward before a `cut_after` cut (0: no cut)."""
        marker = self._cut_marker
        if not marker:
            return 0
        seen = conn.sent_tail + data
        conn.sent_tail = seen[-(len(marker) - 1) :] if len(marker) > 1 else b""
        at = seen.find(marker)
        if at < 0:
            return 0
        self._cut_marker = b""
        self._refusing = True
        self.cuts += 1
        return at + len(marker) - (len(seen) - len(data))

    async def _write(self, conn: _Conn, writer: asyncio.StreamWriter, direction: int) -> None:
        queue, ready = conn.queues[direction], conn.ready[direction]
        try:
            while not conn.closed:
                if not queue:
                    ready.clear()
                    await ready.wait()
                    continue
                at, data = queue[0]
                wait = max(at, conn.stalled_until) - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(min(wait, 0.05))
                    continue
                queue.popleft()
                if not data:
                    break
                writer.write(data)
                self.stats.forwarded_bytes += len(data)
                await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        if not conn.closed:
            # one side ended: end both, like a real connection would
            conn.closed = True
            self._conns.discard(conn)
            for w in (conn.client, conn.server):
                with contextlib.suppress(Exception):
                    w.close()
            for task in conn.tasks:
                if task is not asyncio.current_task():
                    task.cancel()
