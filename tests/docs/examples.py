"""Every Python and shell block of README.md and docs/, run as a reader runs them.

A page is run as one reader runs it, top to bottom, in one shell, in a scratch directory
of its own (README.md: in a copy of the checkout, since its Quick start starts from one).
Fenced blocks, by language:

- ``python`` with ``title="PATH.py"``: saved as PATH.py (relative to the page's directory)
  for another block to run (``python PATH.py``, ``uvicorn PATH:app``); a saved file that no
  other block of the page names fails the page, since nothing would have run it.
- ``python`` without a title: a complete script, run at once with ``python``. If it leaves a
  module-level ``app`` or ``application``, that ASGI app is then started and stopped through
  the lifespan, as a server does (the middleware checks its store there).
- ``sh`` and ``bash``: run with ``bash -e -o pipefail``; the block must exit 0.
- ``console``: the text after ``$ `` on a line is a command, the lines after it what it
  prints. The commands run as one bash script (one ending in ``&`` runs in the background and
  the script waits for it at the end), which must exit 0; each printed line must match a line
  of what its command printed, in order. A transcript may leave lines out (a response
  shortened to the lines that matter); ``...`` in a printed line matches any text; ``\\r``
  and trailing spaces are ignored.
- anything else (``text``: server logs, configuration lines, sample output) is not code and
  is not run.

Directives, an HTML comment on the line just before a block (GitHub and the site hide it):

- ``<!-- serve -->``: the block's last command is a server. The earlier commands run to
  completion, then the server starts in the background, and the block is done when its port
  accepts connections. It is stopped (SIGTERM to its process group, by id) when the page ends,
  or before a later server takes its port (the reader's Ctrl-C). A ``console`` block's printed
  lines are matched against what the server wrote, once it has stopped.
- ``<!-- not run: REASON -->``: a block the tests cannot run: only ``bash .ci/run``, the
  command that runs them.
- ``<!-- install -->``: the page's install line, before its first block that runs: the
  line for a checkout, then the same extras and packages as the line for once it is
  published, ``pip install -e '.[EXTRAS]' PACKAGE...  # published: pip install
  'goblin-idem[EXTRAS]' PACKAGE...`` (``pip install -e .`` and ``goblin-idem`` without
  extras). A page without one needs the package alone, ``pip install -e .``.

What a block sees:

- ``python`` and the console scripts of a venv built from the page's install line alone
  (its ``bin`` first on ``PATH``, as if activated), so a block that needs a package its
  page's line does not install fails here, not for a reader. The venv is built with uv
  (``uv pip install`` and the line's arguments, in the checkout), once for every page with
  the same line, and kept under ``.cache/docs-venvs/`` for later runs until the line or
  pyproject.toml changes. It has no ``pip``: a page that installs makes its venv first, as
  README.md does. What a shell block exports stays set for the page's later blocks, as in
  one shell: ``export NAME=...``, a venv's ``bin/activate``.
- ``REDIS_URL``: a redis-server the fixtures started on a free loopback port (its data
  flushed before each page), until the page exports its own.
- ``POSTGRES_URL``, for a page that names it: a new database (``postgresql://...``) on a
  PostgreSQL the fixtures started on a free loopback port.
- Ports: every port number a page writes after ``127.0.0.1:``, ``localhost:`` or ``--port``
  stands for a free loopback port, the same one wherever the page writes that number (in
  code and in printed output alike). A server command of uvicorn, ``python -m example_app``
  or ``mkdocs serve`` that names no port serves on 8000, their default, and is given the port
  that stands for 8000. No block ever reaches a server that the page or the fixtures did not
  start.
- ``XDG_CACHE_HOME``: a scratch directory (``build-module`` caches its build there); pip
  keeps its own cache (``PIP_CACHE_DIR``), as a reader's does.
- ``PYTHONPATH``: the checkout, as for a reader whose shell is in it (the Quick start's), so
  ``python -m example_app`` is found; the example app is not part of the installed package.
  A page's own files are written to a directory of its own, not to the checkout.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.parser import Parser
from pathlib import Path

from tests.support.procs import ROOT
from tests.support.servers import free_port

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN = frozenset({"python", "sh", "bash", "console"})
FENCE = re.compile(
    r"^(?P<fence>```+)(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.M | re.S
)
DIRECTIVE = re.compile(r"<!--\s*(serve|install|not run:[^>]*?)\s*-->\s*$")
PACKAGES = r"(?P<packages>(?: [\w\[\],.'<>=!~-]+)*)"
CHECKOUT = re.compile(rf"pip install -e (?:'\.\[(?P<extras>[\w,-]+)\]'|\.){PACKAGES}")
PUBLISHED = re.compile(
    rf"# published: pip install (?:'goblin-idem\[(?P<extras>[\w,-]+)\]'|goblin-idem){PACKAGES}"
)
BASE = "pip install -e ."  # a page without an install line needs the package alone
VENVS = ROOT / ".cache" / "docs-venvs"
PORT = re.compile(r"(127\.0\.0\.1:|localhost:|--port[ =])(\d{2,5})\b")
SHELL_OWN = frozenset({"PWD", "OLDPWD", "SHLVL", "_"})  # bash's, not the page's
DEFAULT_PORT = 8000  # uvicorn's, the example app's and mkdocs serve's
LISTEN = re.compile(  # a server's own port: uvicorn's, mkdocs serve's, gunicorn's
    r"(?:--port[ =]|--dev-addr[ =]127\.0\.0\.1:|--bind[ =]127\.0\.0\.1:)(\d+)"
)
DEFAULT_ADDRESS = {  # how each server that defaults to it is told a port
    r"\buvicorn ": " --port {}",
    r"-m example_app\b": " --port {}",
    r"\bmkdocs serve\b": " --dev-addr 127.0.0.1:{}",
}
END = "--- end of output ---"
TIMEOUT = 300.0

# Runs a script; then, if it left an ASGI `app` or `application`, one lifespan of it.
RUNNER = """
import asyncio, runpy, sys

space = runpy.run_path(sys.argv[1], run_name="__main__")
app = space.get("app") or space.get("application")


async def lifespan():
    steps = ["lifespan.startup", "lifespan.shutdown"]

    async def receive():
        return {"type": steps.pop(0)}

    async def send(message):
        if message["type"].endswith(".failed"):
            raise SystemExit(f"{message['type']}: {message.get('message', '')}")

    await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)


if callable(app):
    asyncio.run(lifespan())
"""


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    title: str | None
    body: str
    directive: str = ""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in RUN and not self.directive.startswith("not run")

    def commands(self) -> list[str]:
        """A console block's commands, or a shell block's lines."""
        if self.lang == "console":
            return [line[2:] for line in self.body.splitlines() if line.startswith("$ ")]
        return [line for line in self.body.splitlines() if line.strip()]

    def printed(self) -> list[list[str]]:
        """A console block's printed lines, for each of its commands."""
        each: list[list[str]] = []
        for line in self.body.splitlines():
            if line.startswith("$ "):
                each.append([])
            elif each:
                each[-1].append(line)
        return each


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        info = m["info"].strip()
        lang = info.split()[0].lower() if info else ""
        title = re.search(r'title="([^"]+)"', info)
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        directive = DIRECTIVE.search(before)
        found.append(
            Block(
                page,
                text.count("\n", 0, m.start()) + 1,
                lang,
                title[1] if title else None,
                m["body"],
                directive[1] if directive else "",
            )
        )
    return found


def matches(printed: list[str], output: str) -> str | None:
    """The first printed line that no line of `output` matches in order, or None."""
    lines = [line.rstrip() for line in output.replace("\r", "").splitlines()]
    at = 0
    for want in (p.rstrip() for p in printed if p.strip()):
        pattern = re.compile(".*?".join(re.escape(part) for part in want.split("...")))
        while at < len(lines) and not pattern.fullmatch(lines[at]):
            at += 1
        if at == len(lines):
            return want
        at += 1
    return None


@dataclass
class Server:
    block: Block
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> str:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        return self.log.read_text(errors="replace")


@dataclass
class Session:
    """One page's run: its directory, environment, ports and servers."""

    dir: Path
    env: dict[str, str]
    scratch: Path
    ports: dict[int, int] = field(default_factory=dict)
    servers: list[Server] = field(default_factory=list)

    def ported(self, text: str) -> str:
        def swap(m: re.Match[str]) -> str:
            number = int(m[2])
            if number not in self.ports:
                self.ports[number] = free_port()
            return f"{m[1]}{self.ports[number]}"

        return PORT.sub(swap, text)

    def run(self, block: Block) -> None:
        if block.lang == "python" and block.title:
            path = self.dir / block.title
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self.ported(block.body))
        elif block.lang == "python":
            path = self.scratch / f"block_{block.line}.py"
            path.write_text(self.ported(block.body))
            self.shell(block, f"python -c {shlex.quote(RUNNER)} {shlex.quote(str(path))}")
        elif block.directive == "serve":
            self.serve(block)
        elif block.directive == "install":
            pass  # the page's venv was built from it
        elif block.lang == "console":
            between = f"printf '\\n%s\\n' {shlex.quote(END)}"  # each command's output apart
            each = [f"{c}\n{between}" for c in block.commands()]
            out = self.shell(block, "\n".join([*each, "wait"]))
            outputs = out.split(f"\n{END}\n")
            for printed, output in zip(block.printed(), outputs, strict=False):
                self.expect(block, printed, output)
        else:
            self.shell(block, block.body)

    def shell(self, block: Block, script: str) -> str:
        """Run `script`; what it exports (``export``, a venv's ``activate``) stays set for
        the page's later blocks, as in one shell."""
        saved = self.scratch / "env"
        script = f"{self.ported(script)}\nenv -0 > {shlex.quote(str(saved))}"
        proc = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", script],
            cwd=self.dir,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=TIMEOUT,
        )
        out = proc.stdout.decode(errors="replace")
        assert proc.returncode == 0, f"{block.where}: exit status {proc.returncode}\n{out}"
        pairs = (item.split("=", 1) for item in saved.read_text().split("\0") if "=" in item)
        self.env = {k: v for k, v in pairs if k not in SHELL_OWN}
        return out

    def expect(self, block: Block, printed: list[str], output: str) -> None:
        missing = matches([self.ported(line) for line in printed], output)
        assert missing is None, f"{block.where}: not printed: {missing!r}\nprinted:\n{output}"

    def serve(self, block: Block) -> None:
        *before, command = block.commands()
        if before:
            self.shell(block, "\n".join(before))
        command = command.split(" #", 1)[0].rstrip()
        for name, form in DEFAULT_ADDRESS.items():
            if re.search(name, command) and not LISTEN.search(command):
                command += form.format(DEFAULT_PORT)
        command = self.ported(command)
        port = int(LISTEN.findall(command)[-1])
        for taken in [s for s in self.servers if s.port == port]:
            self.servers.remove(taken)
            self.finish(taken)
        log = self.scratch / f"server_{block.line}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                ["bash", "-c", command],
                cwd=self.dir,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, stopped by id
            )
        server = Server(block, port, proc, log)
        self.servers.append(server)
        # A server command may install first (README's `pip install -e '.[docs]' && mkdocs
        # serve`: the docs extra into a fresh venv, then the whole site built).
        deadline = time.monotonic() + 240
        while not accepts(port):
            said = log.read_text(errors="replace")
            assert proc.poll() is None, f"{block.where}: the server exited: {said}"
            assert time.monotonic() < deadline, f"{block.where}: no server on {port}: {said}"
            time.sleep(0.05)

    def finish(self, server: Server) -> None:
        output = server.stop()
        if server.block.lang == "console":
            self.expect(server.block, server.block.printed()[-1], output)

    def close(self) -> None:
        servers, self.servers = self.servers, []
        errors = []
        for server in reversed(servers):  # stopped even when an earlier check fails
            try:
                self.finish(server)
            except AssertionError as exc:
                errors.append(str(exc))
        assert not errors, "\n".join(errors)


def install_line(page: list[Block]) -> str:
    """The page's install line for a checkout: its install directive's, or the package alone."""
    lines = [b for b in page if b.directive == "install"]
    if not lines:
        return BASE
    block = lines[0]
    form = (
        "an install line is `pip install -e '.[EXTRAS]' PACKAGE...  "
        "# published: pip install 'goblin-idem[EXTRAS]' PACKAGE...`"
    )
    assert len(lines) == 1, f"{block.where}: a page has one install line"
    assert block is next(b for b in page if b.runs), f"{block.where}: the page starts with it"
    checkout, hash_, published = block.body.strip().partition("#")
    here = CHECKOUT.fullmatch(checkout.strip())
    there = PUBLISHED.fullmatch(f"{hash_}{published}".strip())
    assert here and there, f"{block.where}: {form}: {block.body.strip()}"
    named = [(m["extras"], m["packages"].split()) for m in (here, there)]
    assert named[0] == named[1], f"{block.where}: the two lines name different packages: {named}"
    return here[0]


def venv_python(line: str) -> Path:
    """The python of a venv with `line` installed (from the checkout) and nothing else."""
    setup = digest((ROOT / "pyproject.toml").read_text())  # a new one prunes the others
    venv = VENVS / f"{setup}-{digest(line, sys.version, str(ROOT))}"
    return _built(venv, line) / "bin" / "python"


def digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


@functools.cache
def _built(venv: Path, line: str) -> Path:
    """`venv`, built once for all the test run's workers (a lock per venv) and kept for later
    runs: it is complete once its `installed` file names the line."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    done = venv / "installed"
    with open(venv.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.is_file():
            shutil.rmtree(venv, ignore_errors=True)  # what a stopped build left
            uv("venv", "--python", getattr(sys, "_base_executable", sys.executable), venv)
            uv("pip", "install", "--python", venv / "bin" / "python", *shlex.split(line)[2:])
            [meta] = venv.glob("lib/python*/site-packages/goblin_idem-*.dist-info/METADATA")
            offered = Parser().parsestr(meta.read_text()).get_all("Provides-Extra") or []
            m = CHECKOUT.fullmatch(line)
            unknown = set(m["extras"].split(",") if m and m["extras"] else ()) - set(offered)
            assert not unknown, f"{line}: goblin-idem has no extra {sorted(unknown)}"
            done.write_text(f"{line}\n")
            prune(venv)
    return venv


def prune(current: Path) -> None:
    """Remove the venvs built for another pyproject.toml: no run of this checkout asks for
    them again. One whose lock is held (being built) is left."""
    setup = current.name.split("-")[0]
    for path in VENVS.glob("*.lock"):
        if path.name.startswith(f"{setup}-"):
            continue
        with open(path, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            shutil.rmtree(path.with_suffix(""), ignore_errors=True)
            path.unlink()


def uv(*args: str | Path) -> None:
    """Run uv in the checkout, as the install line runs from it."""
    proc = subprocess.run(
        [sys.executable, "-m", "uv", "--quiet", *map(str, args)],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, f"uv {shlex.join(map(str, args))}:\n{proc.stderr}"


def accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def unnamed_files(page: list[Block]) -> list[str]:
    """Saved files (titled python blocks) that no other block of the page names."""
    missing = []
    for block in page:
        if block.lang != "python" or not block.title:
            continue
        dotted = block.title.removesuffix(".py").replace("/", ".")
        parts = dotted.split(".")
        names = {block.title, *(".".join(parts[i:]) for i in range(len(parts)))}
        others = [b.body for b in page if b is not block and b.runs]
        if not any(re.search(rf"(?<![\w.]){re.escape(n)}\b", o) for n in names for o in others):
            missing.append(f"{block.where}: {block.title} is saved but no block runs it")
    return missing


NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    ".venv*",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    ".cache",
    ".hypothesis",
)


def environment(
    scratch: Path, python: Path, redis_url: str, postgres_url: str | None = None
) -> dict[str, str]:
    # Nothing of the test process's own settings: its Redis, goblin-idem's variables, the
    # Django settings the Django tests set for their worker process, its venv.
    own = ("REDIS_", "GOBLIN_", "DJANGO_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(own)}
    tests = {Path(sys.executable).parent, Path(sys.prefix) / "bin"}
    if "VIRTUAL_ENV" in env:
        tests.add(Path(env["VIRTUAL_ENV"]) / "bin")
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p) not in tests]
    env["PATH"] = os.pathsep.join([str(python.parent), *path])
    env["VIRTUAL_ENV"] = str(python.parent.parent)  # as activated
    env["PYTHONPATH"] = str(ROOT)  # as from a shell in the checkout: `python -m example_app`
    env["REDIS_URL"] = redis_url
    if postgres_url is not None:  # a page that names POSTGRES_URL: a database of its own
        env["POSTGRES_URL"] = postgres_url
    # pip's cache stays the reader's (README.md's venv installs with pip), the rest is new.
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    env.setdefault("PIP_CACHE_DIR", str(cache / "pip"))
    env["XDG_CACHE_HOME"] = str(scratch / "cache")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run_page(
    page: Path, redis_url: str, tmp: Path, postgres_url: str | None = None
) -> Iterator[Block]:
    """Run every block of `page` in order; yields each block as it has run."""
    found = blocks(page)
    assert not unnamed_files(found), unnamed_files(found)
    python = venv_python(install_line(found))
    scratch = Path(tempfile.mkdtemp(dir=tmp, prefix="scratch-"))
    if page.name == "README.md" and page.parent == ROOT:
        directory = tmp / "checkout"
        shutil.copytree(ROOT, directory, ignore=NOT_SOURCE)
    else:
        directory = tmp / "work"
        directory.mkdir()
    env = environment(scratch, python, redis_url, postgres_url)
    session = Session(directory, env, scratch)
    try:
        for block in found:
            if block.runs:
                session.run(block)
                yield block
    finally:
        session.close()
