"""The package as a user installs it before it is on PyPI: `python -m build` makes an sdist
and a wheel (built from the sdist) that carry the module's C source; the wheel installs into
a clean venv, where the middleware replays and `build-module` compiles the packaged source
into a module that Redis loads. And `build-module`'s errors name its own --cc flag."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

from tests.docs.examples import NOT_SOURCE
from tests.support.procs import stop
from tests.support.servers import start_server

ROOT = Path(__file__).resolve().parent.parent

USE = textwrap.dedent(
    """
    import asyncio, sys
    import goblin_idem
    from goblin_idem import IdempotencyMiddleware, MemoryStore, native

    runs = []

    async def app(scope, receive, send):
        runs.append(1)
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"run %d" % len(runs)})

    async def call(mw):
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/pay", "query_string": b"",
                 "headers": [(b"idempotency-key", b"k1")]}
        await mw(scope, receive, send)
        return sent[-1]["body"], dict(sent[0]["headers"]).get(b"idempotent-replayed")

    async def main():
        mw = IdempotencyMiddleware(app, store=MemoryStore())
        print(await call(mw), await call(mw), len(runs))

    asyncio.run(main())
    print(native.source_path())
    print(goblin_idem.__file__)
    """
)


# A user's environment: none of the test run's PYTHON* variables, whose PYTHONPATH names the
# checkout and would have the clean venv import the checkout instead of the wheel.
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}


def run(*args: str | Path, cwd: Path | None = None) -> str:
    proc = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=CLEAN_ENV, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, f"{args}: {proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_the_built_wheel_installs_and_builds_the_module_in_a_clean_venv(tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)  # the checkout stays untouched
    run(sys.executable, "-m", "build", "--outdir", tmp_path / "dist", source)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    assert "goblin_idem/native/goblin_module.c" in zipfile.ZipFile(wheel).namelist()
    assert any(
        n.endswith("goblin_idem/native/goblin_module.c") for n in tarfile.open(sdist).getnames()
    )

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)  # no --system-site-packages: nothing but the wheel
    python = venv / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel)
    out = run(python, "-c", USE, cwd=tmp_path).splitlines()
    assert out[0] == "(b'run 1', None) (b'run 1', b'true') 1"
    assert out[1].startswith(str(venv)) and out[1].endswith("goblin_module.c")
    assert out[2].startswith(str(venv / "lib"))  # the wheel's package, not the checkout's

    built = run(
        python, "-m", "goblin_idem", "build-module", "--out", tmp_path / "mod", cwd=tmp_path
    )
    module = built.splitlines()[-1]
    assert module == str(tmp_path / "mod" / "goblin.so")
    server = start_server("redis", modules=[module])
    try:
        with server.sync_client() as r:
            assert r.execute_command("GOBLIN.CLAIM", "c", "r", "tok", "10") == b"CLAIMED"
    finally:
        server.stop()


TASKS = textwrap.dedent(
    """
    import os

    from celery import Celery

    from goblin_idem import MemoryStore, once

    app = Celery("tasks", broker=os.environ["REDIS_URL"], backend=os.environ["REDIS_URL"])
    store = MemoryStore()


    @app.task
    @once(store, key=lambda order: f"order-{order}")
    def ship(order):
        return f"shipped {order}"
    """
)


def test_the_celery_extra_runs_a_worker_on_a_redis_broker(tmp_path: Path) -> None:
    """``goblin-idem[celery]`` in a clean venv is enough for a Celery worker whose broker is
    Redis (kombu's Redis transport imports more than Celery requires)."""
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", "--disable-pip-version-check", f"{source}[celery]")
    (tmp_path / "tasks.py").write_text(TASKS)
    server = start_server("redis")
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "REDIS_URL": server.url}
    worker = subprocess.Popen(
        [python, "-m", "celery", "-A", "tasks", "worker", "--pool", "solo", "--loglevel", "error"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        sent = subprocess.run(
            [python, "-c", "import tasks; print(tasks.ship.delay(7).get(timeout=60))"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
    finally:
        stop(worker)
        server.stop()
    assert sent.returncode == 0, sent.stderr
    assert sent.stdout.strip() == "shipped 7"


def test_a_failed_compile_names_the_cc_flag(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "goblin_idem", "build-module", "--cc", "false", "--out", tmp_path],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "with false failed (exit 1); another compiler is named with " in proc.stderr
    assert "`build-module --cc COMPILER`" in proc.stderr
