"""Build the optional `goblin` server module (GOBLIN.CLAIM / CAEXPIRE / CAS / CAD).

The module is one C file with no build dependencies besides a C compiler. Load the
result with `redis-server --loadmodule <path>` (Redis 7+) or `valkey-server --loadmodule
<path>` (Valkey 8+), or `MODULE LOAD <path>` where the server allows it.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["CFLAGS", "MODULE_FILENAME", "build_module", "source_path"]

MODULE_FILENAME = "goblin.so"
CFLAGS = ("-O2", "-fPIC", "-shared", "-std=c11", "-Wall", "-Wextra", "-Werror")


def source_path() -> Path:
    """The module's C source, shipped inside the package."""
    return Path(__file__).with_name("goblin_module.c")


def _compiler(cc: str | None) -> list[str]:
    # $CC may carry a wrapper or flags ("ccache gcc"), so it is split like a shell would.
    command = cc or os.environ.get("CC") or "cc"
    argv = shlex.split(command)
    if not argv or shutil.which(argv[0]) is None:
        raise RuntimeError(
            f"no C compiler found (tried {command!r}); install one (e.g. gcc or clang) "
            "or pass cc=... / set $CC"
        )
    return argv


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "goblin-idem"


def _digest(source: bytes) -> str:
    h = hashlib.sha256(source)
    h.update("\0".join(CFLAGS).encode())
    return h.hexdigest()[:16]


def build_module(out_dir: str | os.PathLike[str] | None = None, *, cc: str | None = None) -> Path:
    """Compile the module and return the absolute path of the `.so`.

    Without `out_dir` the result goes to a per-user cache directory keyed by a hash of the
    source and flags (`$XDG_CACHE_HOME/goblin-idem/<hash>/`, default `~/.cache`), and an
    existing build there is reused, so the compiler only runs when the source changed.
    With `out_dir` the module is always compiled into that directory.

    The file is compiled under a temporary name and renamed into place, so a reader never
    sees a half-written module. Raises `RuntimeError` when no compiler is available or
    the compilation fails (the message carries the compiler's output).
    """
    src = source_path()
    source = src.read_bytes()
    cached = out_dir is None
    target_dir = _cache_root() / _digest(source) if out_dir is None else Path(out_dir)
    target = (target_dir / MODULE_FILENAME).absolute()
    if cached and target.is_file():
        return target
    compiler = _compiler(cc)
    target_dir.mkdir(parents=True, exist_ok=True)

    fd, tmp_name = tempfile.mkstemp(prefix=".goblin-", suffix=".so", dir=target_dir)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        proc = subprocess.run(
            [*compiler, *CFLAGS, "-o", str(tmp), str(src)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"compiling {src.name} with {' '.join(compiler)} failed "
                f"(exit {proc.returncode}):\n{proc.stderr.strip() or proc.stdout.strip()}"
            )
        # --loadmodule refuses a module file without the execute bit.
        tmp.chmod(0o755)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
