"""Child processes for the tests and benchmarks: uvicorn (one process, or a supervisor with
worker processes) or granian serving an app of tests/support/apps, the example app, and
scripts run with ``python -m``. Each is started by PID and stopped by PID (`stop`, the one
place that ends a process, servers.py included), so nothing outlives a test.

Standard library only: bench/ imports this module from its own venv, which has no httpx.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from tests.support.waits import START_DEADLINE

ROOT = Path(__file__).resolve().parents[2]
APPS = "tests.support.apps"
TASK_APP = f"{APPS}.task_app:app"


def spawn(
    args: list[str], env: dict[str, str], *, stderr: int | IO[bytes] = subprocess.PIPE
) -> subprocess.Popen[bytes]:
    """`python *args` from the project root, so ``tests.support.apps.*`` imports."""
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 10) -> None:
    """End `proc` by its PID with `sig`, then SIGKILL if it is still there after `timeout`."""
    if proc.poll() is None:
        os.kill(proc.pid, sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)
    if proc.stderr is not None:
        proc.stderr.close()


def output_of(proc: subprocess.Popen[bytes]) -> str:
    """Stop `proc` (SIGTERM, a clean shutdown) and return what it wrote to stderr."""
    assert proc.stderr is not None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=20)
    finally:
        stop(proc)
    return err.decode()


def http_status(port: int, path: str, timeout: float = 1.0) -> int | None:
    """The status of ``GET path`` on 127.0.0.1:`port`, or None if nothing answers."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def wait_http(
    proc: subprocess.Popen[bytes],
    port: int,
    *,
    path: str = "/health",
    name: str = "the server",
    timeout: float = START_DEADLINE,
    output: Callable[[], str] | None = None,
) -> subprocess.Popen[bytes]:
    """Until ``GET path`` answers 200; RuntimeError (with the process's output) if `proc`
    exits or `timeout` passes first, and then `proc` is stopped."""
    deadline = time.monotonic() + timeout
    while http_status(port, path) != 200:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited ({proc.returncode}): {_output(proc, output)}")
        if time.monotonic() > deadline:
            said = _output(proc, output)
            stop(proc, signal.SIGKILL)
            raise RuntimeError(f"{name} did not answer in {timeout:g} s: {said}")
        time.sleep(0.05)
    return proc


def _output(proc: subprocess.Popen[bytes], output: Callable[[], str] | None) -> str:
    if output is not None:
        return output()
    if proc.stderr is not None and proc.poll() is not None:
        return proc.stderr.read().decode(errors="replace")
    return ""


def uvicorn_args(app: str, port: int, log_level: str = "warning", workers: int = 1) -> list[str]:
    args = ["-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port)]
    args += ["--log-level", log_level]
    return args + (["--workers", str(workers)] if workers > 1 else [])


def start_uvicorn(
    port: int, env: dict[str, str], timeout: float = START_DEADLINE, app: str = TASK_APP
) -> subprocess.Popen[bytes]:
    """`app` (``module:app`` with a ``/health`` route) under uvicorn, one process."""
    proc = spawn(uvicorn_args(app, port), env)
    return wait_http(proc, port, name="uvicorn", timeout=timeout)


def start_granian(
    port: int, env: dict[str, str], target: str, timeout: float = START_DEADLINE
) -> subprocess.Popen[bytes]:
    """Granian, one worker, serving `target` (module:app, which answers GET /health).
    Granian offers the http.response.pathsend extension that uvicorn does not."""
    args = ["-m", "granian", "--interface", "asgi", "--host", "127.0.0.1", "--port", str(port)]
    args += ["--workers", "1", "--no-ws", "--log-level", "warning", target]
    return wait_http(spawn(args, env), port, name="granian", timeout=timeout)


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
    try:
        return wait_http(proc, port, path="/stats", name="the app", output=log.read_text)
    except RuntimeError as exc:
        stop(proc)
        raise AssertionError(str(exc)) from None


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
    """``tests.support.apps.task_app:app`` under uvicorn, with ``--workers N`` when N > 1: a
    supervisor process and N worker processes (the supervisor restarts a worker that dies).
    `stop` ends the supervisor by its PID and then every worker it had, by PID."""

    def __init__(self, port: int, env: dict[str, str], *, workers: int = 1) -> None:
        self.port = port
        self.workers = workers
        self.url = f"http://127.0.0.1:{port}"
        args = [*uvicorn_args(TASK_APP, port, "critical", workers), "--no-access-log"]
        self.proc = spawn(args, env, stderr=subprocess.DEVNULL)
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

    def wait_ready(self, timeout: float = START_DEADLINE) -> None:
        """Until every worker runs and the port answers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"uvicorn exited with {self.proc.returncode}")
            if len(self.worker_pids()) >= self.workers and http_status(self.port, "/health"):
                return
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
        stop(self.proc)
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


def in_child(work: Callable[[], Any], timeout: float = 20) -> Any:
    """Run `work` in a forked child; what it returned, or the error it raised, as text."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once, running nothing of the parent's
        os.close(read)
        try:
            outcome: Any = work()
        except BaseException as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        with os.fdopen(write, "w") as out:
            json.dump(outcome, out)
        os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], timeout)
        if not ready:
            raise AssertionError("the child did not answer")
        with os.fdopen(read) as got:
            return json.load(got)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
