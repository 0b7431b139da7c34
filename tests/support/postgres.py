"""A throwaway PostgreSQL server for the tests: Debian's binaries, a temporary data directory,
a free 127.0.0.1 port of this worker's slice, fsync off; stopped by PID.

The tests run as root and PostgreSQL refuses to, so initdb and the server run as the
``postgres`` user (``runuser``) in a directory it owns, with its socket there too. Never
the machine's own server: it has its own port and data directory.
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.procs import alive
from tests.support.servers import free_port

USER = "postgres"
# Settings that trade durability for speed, for the test servers.
FAST = " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"


def binaries() -> Path:
    """The newest installed PostgreSQL's bin directory (Debian's layout)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version)
    if not found:
        raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
    return Path(found[-1]).parent


def _version(path: str) -> float:
    try:
        return float(Path(path).parent.parent.name)
    except ValueError:
        return 0.0


def _as_postgres(*args: str | Path) -> list[str]:
    return ["runuser", "-u", USER, "--", *(str(a) for a in args)]


@dataclass
class Postgres:
    """One running server; `url(database, driver)` for SQLAlchemy."""

    port: int
    dir: Path
    pid: int = 0
    durable: bool = False  # commits synced, as an application's server would

    def url(self, database: str = "postgres", driver: str = "asyncpg") -> str:
        return f"postgresql+{driver}://{USER}@127.0.0.1:{self.port}/{database}"

    def psql(self, sql: str, database: str = "postgres") -> str:
        """Run `sql` with psql over the socket; its output."""
        done = subprocess.run(
            _as_postgres(
                binaries() / "psql",
                "-h",
                self.dir,
                "-p",
                str(self.port),
                "-d",
                database,
                "-X",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                sql,
            ),
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return done.stdout.strip()

    def new_database(self) -> str:
        name = f"t_{secrets.token_hex(6)}"
        self.psql(f"CREATE DATABASE {name}")
        return name

    def start(self) -> None:
        subprocess.run(
            _as_postgres(
                binaries() / "pg_ctl",
                "-D",
                self.dir / "data",
                "-l",
                self.dir / "server.log",
                "-w",
                "-t",
                "30",
                "-o",
                f"-p {self.port} -c listen_addresses=127.0.0.1 "
                f"-c unix_socket_directories={self.dir} -c max_connections=200"
                + ("" if self.durable else FAST),
                "start",
            ),
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=60,
        )
        self.pid = int((self.dir / "data" / "postmaster.pid").read_text().split()[0])

    def stop(self, *, fast: bool = False) -> None:
        """End the server by its PID, and wait until it is gone: an immediate shutdown (a
        crash, as far as what the last second committed goes: commits are not synced), or
        with `fast` PostgreSQL's fast shutdown (clients cut off, what committed kept)."""
        if self.pid and alive(self.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGINT if fast else signal.SIGQUIT)
            deadline = time.monotonic() + 10
            while alive(self.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if alive(self.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                while alive(self.pid):
                    time.sleep(0.02)
        self.pid = 0

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def start_postgres(*, durable: bool = False) -> Postgres:
    """initdb in a fresh directory and start the server on a free port (trust auth); with
    `durable`, commits are synced (for benchmarks), else not (tests: faster, and a stop
    loses what the last moment committed)."""
    directory = Path(tempfile.mkdtemp(prefix="goblin-pg-"))
    shutil.chown(directory, USER, USER)
    os.chmod(directory, 0o700)
    subprocess.run(
        _as_postgres(
            binaries() / "initdb",
            "-D",
            directory / "data",
            "-U",
            USER,
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
        ),
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=120,
    )
    server = Postgres(free_port(), directory, durable=durable)
    try:
        server.start()
    except BaseException:
        server.remove()
        raise
    return server


@dataclass
class PgBouncer:
    """A PgBouncer in front of `server`, in `pool_mode`; stopped by PID."""

    port: int
    dir: Path
    pid: int = 0

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        if self.pid and alive(self.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while alive(self.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if alive(self.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
        self.pid = 0
        shutil.rmtree(self.dir, ignore_errors=True)


def start_pgbouncer(server: Postgres, pool_mode: str = "transaction") -> PgBouncer:
    """Debian's pgbouncer (it refuses to run as root: as ``postgres``), daemonized on a
    free port, trust auth, a small server pool so that clients share server connections."""
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not Path(binary).exists():
        raise RuntimeError("pgbouncer is not installed (apt-get install pgbouncer)")
    directory = Path(tempfile.mkdtemp(prefix="goblin-pgbouncer-"))
    bouncer = PgBouncer(free_port(), directory)
    (directory / "users.txt").write_text(f'"{USER}" ""\n')
    (directory / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host=127.0.0.1 port={server.port}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {bouncer.port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {directory}/users.txt\n"
        f"pool_mode = {pool_mode}\ndefault_pool_size = 4\nmax_client_conn = 400\n"
        f"pidfile = {directory}/pgbouncer.pid\nlogfile = {directory}/pgbouncer.log\n"
        "ignore_startup_parameters = extra_float_digits,synchronous_commit\n"
    )
    for path in (directory, *directory.iterdir()):
        shutil.chown(path, USER, USER)
    try:
        subprocess.run(
            _as_postgres(binary, "-d", directory / "pgbouncer.ini"),
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=30,
        )
        deadline = time.monotonic() + 10
        pidfile = directory / "pgbouncer.pid"
        while not pidfile.exists() or not pidfile.read_text().strip():
            if time.monotonic() > deadline:
                raise RuntimeError("pgbouncer did not start")
            time.sleep(0.02)
        bouncer.pid = int(pidfile.read_text().split()[0])
    except BaseException:
        bouncer.stop()
        raise
    return bouncer


def start_standby(primary: Postgres) -> Postgres:
    """A streaming standby of `primary` (pg_basebackup -R) on a free port, started."""
    directory = Path(tempfile.mkdtemp(prefix="goblin-pg-standby-"))
    shutil.chown(directory, USER, USER)
    os.chmod(directory, 0o700)
    subprocess.run(
        _as_postgres(
            binaries() / "pg_basebackup",
            "-h",
            "127.0.0.1",
            "-p",
            str(primary.port),
            "-U",
            USER,
            "-D",
            directory / "data",
            "-R",
            "-X",
            "stream",
            "--no-sync",
        ),
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=120,
    )
    standby = Postgres(free_port(), directory, durable=primary.durable)
    try:
        standby.start()
    except BaseException:
        standby.remove()
        raise
    return standby


def promote(standby: Postgres) -> None:
    """`pg_ctl promote`, waiting until the standby accepts writes."""
    subprocess.run(
        _as_postgres(binaries() / "pg_ctl", "-D", standby.dir / "data", "-w", "promote"),
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=60,
    )
