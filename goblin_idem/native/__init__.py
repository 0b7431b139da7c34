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
            f"no C compiler found (tried {command!r}); install one (e.g. gcc or clang), "
            "or name it with `build-module --cc COMPILER` (`cc=` from Python) or $CC"
        )
    return argv


def _private_dir(path: Path) -> Path:
    """Create `path` (mode 0700) if needed; refuse it unless it is ours and only ours to write.

    The cached module is later loaded into a server process, so a cache directory that
    another user owns or can write to could hand us their code.
    """
    fix = "set $XDG_CACHE_HOME to a directory of your own, or build with `build-module --out DIR`"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError as exc:
        raise RuntimeError(f"cannot use the module cache {path}: {exc}; {fix}") from exc
    if st.st_uid != os.geteuid():
        raise RuntimeError(
            f"refusing the module cache {path}: it is owned by uid {st.st_uid}, not by you "
            f"(uid {os.geteuid()}); remove it, or {fix}"
        )
    if st.st_mode & 0o022:
        raise RuntimeError(
            f"refusing the module cache {path}: it is writable by group or others "
            f"(mode {st.st_mode & 0o777:o}); run `chmod 700 {path}`, or {fix}"
        )
    return path


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "goblin-idem"


def _digest(source: bytes) -> str:
    h = hashlib.sha256(source)
    h.update("\0".join(CFLAGS).encode())
    return h.hexdigest()[:16]


def _hash_path(module: Path) -> Path:
    return module.with_name(module.name + ".sha256")


def _verified(module: Path) -> bool:
    """Whether `module` is the file our build wrote: its SHA-256 matches the one next to it."""
    try:
        recorded = _hash_path(module).read_text().strip()
        actual = hashlib.sha256(module.read_bytes()).hexdigest()
    except OSError:
        return False
    return recorded == actual


def build_module(out_dir: str | os.PathLike[str] | None = None, *, cc: str | None = None) -> Path:
    """Compile the module and return the absolute path of the `.so`.

    Without `out_dir` the result goes to a per-user cache directory keyed by a hash of the
    source and flags (`$XDG_CACHE_HOME/goblin-idem/<hash>/`, default `~/.cache`), and an
    existing build there is reused, so the compiler only runs when the source changed.
    The cache directories are created with mode 0700 and refused (`RuntimeError`) when
    another user owns them or group or others can write to them. The build writes the
    module's SHA-256 next to it (`goblin.so.sha256`); a cached module that does not match
    it (torn write, a file our build did not write) is compiled again, never loaded.
    With `out_dir` the module is always compiled into that directory.

    The file is compiled under a temporary name and renamed into place, so a reader never
    sees a half-written module. Raises `RuntimeError` when no compiler is available or
    the compilation fails (the message carries the compiler's output).
    """
    src = source_path()
    source = src.read_bytes()
    cached = out_dir is None
    if out_dir is None:
        target_dir = _private_dir(_private_dir(_cache_root()) / _digest(source))
    else:
        target_dir = Path(out_dir)
    target = (target_dir / MODULE_FILENAME).absolute()
    if cached and _verified(target):
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
                f"(exit {proc.returncode}); another compiler is named with "
                f"`build-module --cc COMPILER` (`cc=` from Python) or $CC:\n"
                f"{proc.stderr.strip() or proc.stdout.strip()}"
            )
        # --loadmodule refuses a module file without the execute bit.
        tmp.chmod(0o755)
        if cached:
            # Whatever the interleaving with another build or a crash, a module and a hash
            # that do not match are compiled again, never returned.
            _hash_path(target).write_text(hashlib.sha256(tmp.read_bytes()).hexdigest() + "\n")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
