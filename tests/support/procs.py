"""Child processes for the crash, cross-process and client tests: uvicorn or granian serving
a test app or the example app over a real store, and a Lock holder. Each is started by PID and
stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
APPS = "tests.support.apps"


def spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    if proc.stderr is not None:
        proc.stderr.close()


def start_uvicorn(
    port: int, env: dict[str, str], timeout: float = 15.0, app: str = f"{APPS}.crash_app:app"
) -> subprocess.Popen[bytes]:
    """`app` (a module of this directory with a ``/health`` route) under uvicorn."""
    proc = spawn(
        [
            "-m",
            "uvicorn",
            app,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env,
    )
    return _wait_http(proc, f"http://127.0.0.1:{port}/health", "uvicorn", timeout)


def start_granian(
    port: int, env: dict[str, str], target: str, timeout: float = 15.0
) -> subprocess.Popen[bytes]:
    """Granian, one worker, serving `target` (module:app, which answers GET /health).
    Granian offers the http.response.pathsend extension that uvicorn does not."""
    proc = spawn(
        [
            "-m",
            "granian",
            "--interface",
            "asgi",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--no-ws",
            "--log-level",
            "warning",
            target,
        ],
        env,
    )
    return _wait_http(proc, f"http://127.0.0.1:{port}/health", "granian", timeout)


def _wait_http(
    proc: subprocess.Popen[bytes], url: str, name: str, timeout: float
) -> subprocess.Popen[bytes]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise RuntimeError(f"{name} exited: {err}")
        try:
            httpx.get(url, timeout=0.5)
            return proc
        except httpx.HTTPError:
            time.sleep(0.05)
    stop(proc, signal.SIGKILL)
    raise RuntimeError(f"{name} did not answer")


def start_example_app(port: int, log: Path, **env: str) -> subprocess.Popen[bytes]:
    """`python -m example_app --port N` with output to `log`, answering /stats, or fail."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_", "GOBLIN_"))}
    full_env.update(env)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "example_app", "--port", str(port)],
            cwd=ROOT,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 10
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"the app exited ({proc.returncode}):\n{log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/stats", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            stop(proc)
            raise AssertionError(f"the app did not answer in 10 s:\n{log.read_text()}")
        time.sleep(0.05)
