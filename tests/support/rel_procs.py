"""uvicorn processes for the reliability suite, started and stopped by PID.

`Uvicorn` runs ``rel_app:app`` with ``--workers N`` when N > 1: a supervisor process and N
worker processes (the supervisor restarts a worker that dies). `stop` ends the supervisor by
its PID and then every worker it had, by PID, so nothing outlives a test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def children(pid: int) -> list[int]:
    """The direct children of `pid` (Linux /proc)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(p) for p in f.read().split()]
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


class Uvicorn:
    def __init__(self, port: int, env: dict[str, str], *, workers: int = 1) -> None:
        self.port = port
        self.workers = workers
        self.url = f"http://127.0.0.1:{port}"
        args = [
            sys.executable,
            "-m",
            "uvicorn",
            "tests.support.apps.rel_app:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "critical",
            "--no-access-log",
        ]
        if workers > 1:
            args += ["--workers", str(workers)]
        self.proc = subprocess.Popen(
            args,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._seen: set[int] = set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def worker_pids(self) -> list[int]:
        """The processes serving requests: the workers, or the one process without them."""
        if self.workers == 1:
            return [self.pid] if alive(self.pid) else []
        pids = [p for p in children(self.pid) if alive(p)]
        self._seen.update(pids)  # workers and multiprocessing's resource tracker
        return [p for p in pids if b"spawn_main" in _cmdline(p)]

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until every worker runs and the port answers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"uvicorn exited with {self.proc.returncode}")
            if len(self.worker_pids()) >= self.workers:
                try:
                    httpx.get(self.url + "/health", timeout=1.0)
                    return
                except httpx.HTTPError:
                    pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("uvicorn did not become ready")

    def kill_workers(self) -> list[int]:
        """SIGKILL every worker process (not the supervisor, which starts new ones)."""
        pids = self.worker_pids() if self.workers > 1 else []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def stop(self) -> None:
        if self.workers > 1:
            self.worker_pids()
        known = set(self._seen)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for pid in known:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while any(alive(p) for p in known) and time.monotonic() < deadline:
            time.sleep(0.02)

    def __enter__(self) -> Uvicorn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
