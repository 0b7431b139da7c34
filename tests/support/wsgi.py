"""A minimal WSGI server in process (one request in, what the app answered out, its iterable
closed as a server closes it), and gunicorn as a child process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.support.procs import ROOT, alive, children, http_status, spawn, stop
from tests.support.waits import START_DEADLINE

StartResponse = Callable[..., Callable[[bytes], object]]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


@dataclass
class Reply:
    status: str = ""
    headers: list[tuple[str, str]] = field(default_factory=list)
    chunks: list[bytes] = field(default_factory=list)

    @property
    def code(self) -> int:
        return int(self.status.split(" ", 1)[0])

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def header(self, name: str) -> str | None:
        for n, v in self.headers:
            if n.lower() == name.lower():
                return v
        return None

    def json(self) -> Any:
        return json.loads(self.body)


def environ(
    method: str = "POST",
    path: str = "/",
    body: bytes = b"",
    headers: Sequence[tuple[str, str]] = (),
    query: str = "",
    *,
    chunked: bool = False,
) -> dict[str, Any]:
    """A PEP 3333 environ as a server makes it (a chunked body has no CONTENT_LENGTH and
    sets wsgi.input_terminated, as gunicorn does)."""
    env: dict[str, Any] = {
        "REQUEST_METHOD": method,
        "SCRIPT_NAME": "",
        "PATH_INFO": path,
        "QUERY_STRING": query,
        "SERVER_NAME": "127.0.0.1",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "REMOTE_ADDR": "127.0.0.1",
        "REMOTE_PORT": "50000",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
    }
    if chunked:
        env["wsgi.input_terminated"] = True
    else:
        env["CONTENT_LENGTH"] = str(len(body))
    for name, value in headers:
        key = name.upper().replace("-", "_")
        if key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            env[key] = value
        else:
            key = "HTTP_" + key
            env[key] = f"{env[key]},{value}" if key in env else value
    return env


def call(
    app: WSGIApp,
    method: str = "POST",
    path: str = "/",
    body: bytes = b"",
    headers: Sequence[tuple[str, str]] = (),
    *,
    key: str | None = None,
    query: str = "",
    chunked: bool = False,
    read: int | None = None,
) -> Reply:
    """Serve one request as a server does: start_response, every chunk, then close(). With
    `read`, the client leaves after that many chunks (the server closes the iterable early)."""
    if key is not None:
        headers = [*headers, ("Idempotency-Key", key)]
    reply = Reply()

    def start_response(
        status: str, response_headers: list[tuple[str, str]], exc_info: Any = None
    ) -> Callable[[bytes], object]:
        if exc_info is not None and reply.chunks:
            raise exc_info[1].with_traceback(exc_info[2])
        reply.status, reply.headers = status, list(response_headers)
        return reply.chunks.append

    iterable = app(environ(method, path, body, headers, query, chunked=chunked), start_response)
    try:
        for chunk in iterable:
            reply.chunks.append(chunk)
            if read is not None and len(reply.chunks) >= read:
                break
    finally:
        close = getattr(iterable, "close", None)
        if close is not None:
            close()
    return reply


# -- gunicorn -------------------------------------------------------------------------------


class Gunicorn:
    """gunicorn serving `app` (module:callable, answering GET /health) on `port`: `workers`
    processes of `worker_class` (sync, gthread: `threads` each), ``--preload`` if asked."""

    def __init__(
        self,
        app: str,
        port: int,
        env: dict[str, str],
        *,
        worker_class: str = "sync",
        workers: int = 2,
        threads: int = 1,
        preload: bool = False,
        timeout: int = 30,
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        args = ["-m", "gunicorn", "--bind", f"127.0.0.1:{port}", "--workers", str(workers)]
        args += ["--worker-class", worker_class, "--threads", str(threads)]
        args += ["--timeout", str(timeout), "--graceful-timeout", "5", "--log-level", "warning"]
        args += [*(["--preload"] if preload else []), app]
        self.workers = workers
        self.proc = spawn(args, env)
        self._seen: set[int] = set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def worker_pids(self) -> list[int]:
        pids = [p for p in children(self.pid) if alive(p)]
        self._seen.update(pids)
        return pids

    def wait_ready(self, timeout: float = START_DEADLINE) -> Gunicorn:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited ({self.proc.returncode}): {self.output()}")
            if len(self.worker_pids()) >= self.workers and http_status(self.port, "/health"):
                return self
            time.sleep(0.05)
        said = self.output() if self.proc.poll() is not None else ""
        self.stop()
        raise RuntimeError(f"gunicorn did not become ready in {timeout:g} s {said}")

    def output(self) -> str:
        assert self.proc.stderr is not None
        if self.proc.poll() is None:
            return ""
        return self.proc.stderr.read().decode(errors="replace")[-3000:]

    def stop(self) -> None:
        self.worker_pids()
        known = set(self._seen)
        stop(self.proc, signal.SIGINT)  # gunicorn's quick shutdown
        for pid in known:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def run_until_exit(args: list[str], env: dict[str, str], timeout: float = 30) -> tuple[int, str]:
    """`python *args`, expected to exit by itself: its exit code and what it wrote to stderr."""
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=timeout,
    )
    return proc.returncode, proc.stderr.decode(errors="replace")
