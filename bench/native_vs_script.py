"""Native GOBLIN.* commands vs the spec's Lua bodies via EVALSHA, on one server.

For each server kind (Redis 7, Valkey 9) a throwaway server is started on a free loopback
port with the module loaded, and stopped by PID at the end. Every workload runs natively
and as EVALSHA on the same server, same connection and same pipeline depth, alternating
native/script for a few rounds; the medians are reported. Two numbers per variant:

* ops/s - what one pipelining client gets end to end (client-bound in Python);
* usec/call - the server's own time per call, from INFO commandstats
  (cmdstat_goblin.* vs cmdstat_evalsha, which includes the nested redis.call()s).

Usage: python bench/native_vs_script.py [--ops 50000] [--depth 50] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from goblin_idem.native import build_module
from goblin_idem.store._scripts import CAD_LUA, CAEXPIRE_LUA, CAS_LUA, CLAIM_LUA

Cmd = tuple[object, ...]


@contextlib.contextmanager
def server(kind: str, module: Path) -> Iterator[redis.Redis]:
    """A server of `kind` with the module loaded (the test suite's throwaway servers: free
    loopback port, no persistence), ended by its PID on exit."""
    from tests.support.servers import running

    with running(kind, modules=[str(module)]) as srv, srv.sync_client() as client:
        yield client


@dataclass
class Workload:
    name: str
    stat: str  # the command's commandstats name
    lua: str
    nkeys: int
    setup: Callable[[redis.Redis, int], None]
    args: Callable[[int], Sequence[object]]  # keys then argv of the i-th call
    expect: object  # what every call must reply, so nothing silently measures an error


def _setup_none(r: redis.Redis, n: int) -> None:
    pass


def _setup_held(r: redis.Redis, n: int) -> None:
    r.set("claim", "holder", ex=3600)
    r.set("result", "charged:txn_551:" + "x" * 16)


def _setup_lock(r: redis.Redis, n: int) -> None:
    r.set("lock", "token-0123456789", px=30_000)


def _setup_cas(r: redis.Redis, n: int) -> None:
    r.set("doc", "v0", px=30_000)


def _setup_many_locks(r: redis.Redis, n: int) -> None:
    for start in range(0, n, 1000):
        with r.pipeline(transaction=False) as p:
            for i in range(start, min(start + 1000, n)):
                p.set(f"lock:{i}", "token-0123456789", px=300_000)
            p.execute()


WORKLOADS = [
    Workload(
        "CLAIM (won)",
        "goblin.claim",
        CLAIM_LUA,
        2,
        _setup_none,
        lambda i: (f"claim:{i}", f"result:{i}", "worker-3", 30),
        b"CLAIMED",
    ),
    Workload(
        "CLAIM (held -> result)",
        "goblin.claim",
        CLAIM_LUA,
        2,
        _setup_held,
        lambda i: ("claim", "result", "worker-9", 30),
        b"charged:txn_551:" + b"x" * 16,
    ),
    Workload(
        "CAEXPIRE (renew)",
        "goblin.caexpire",
        CAEXPIRE_LUA,
        1,
        _setup_lock,
        lambda i: ("lock", "token-0123456789", 30_000),
        1,
    ),
    Workload(
        "CAS (swap)",
        "goblin.cas",
        CAS_LUA,
        1,
        _setup_cas,
        lambda i: ("doc", f"v{i % 2}", f"v{(i + 1) % 2}"),
        b"OK",
    ),
    Workload(
        "CAD (release)",
        "goblin.cad",
        CAD_LUA,
        1,
        _setup_many_locks,
        lambda i: (f"lock:{i}", "token-0123456789"),
        1,
    ),
]


def commands(w: Workload, n: int, sha: str | None) -> list[Cmd]:
    if sha is None:
        return [(w.stat.upper(), *w.args(i)) for i in range(n)]
    return [("EVALSHA", sha, w.nkeys, *w.args(i)) for i in range(n)]


def run(r: redis.Redis, w: Workload, n: int, depth: int, sha: str | None) -> tuple[float, float]:
    """One variant: returns (ops/s, server usec per call)."""
    r.flushall()
    w.setup(r, n)
    cmds = commands(w, n, sha)
    conn = r.connection_pool.get_connection()
    try:
        batches = [
            (conn.pack_commands(cmds[i : i + depth]), len(cmds[i : i + depth]))  # type: ignore[no-untyped-call]
            for i in range(0, n, depth)
        ]
        r.config_resetstat()
        t0 = time.perf_counter()
        for packed, count in batches:
            conn.send_packed_command(packed, check_health=False)  # type: ignore[no-untyped-call]
            for _ in range(count):
                reply = conn.read_response()
                if reply != w.expect:
                    raise RuntimeError(f"{w.name}: unexpected reply {reply!r}")
        elapsed = time.perf_counter() - t0
    finally:
        r.connection_pool.release(conn)
    stats = r.info("commandstats")
    key = "cmdstat_" + ("evalsha" if sha else w.stat)
    entry = stats[key]
    if int(entry["calls"]) != n:
        raise RuntimeError(f"{key}: {entry['calls']} calls, expected {n}")
    return n / elapsed, float(entry["usec_per_call"])


@dataclass
class Row:
    server: str
    workload: str
    native_ops: float
    script_ops: float
    native_usec: float
    script_usec: float

    @property
    def ratio(self) -> float:
        return self.script_usec / self.native_usec


def bench(kind: str, module: Path, n: int, depth: int, rounds: int) -> list[Row]:
    rows = []
    with server(kind, module) as r:
        version = r.info("server").get("valkey_version") or r.info("server")["redis_version"]
        label = f"{kind} {version}"
        for w in WORKLOADS:
            sha = str(r.script_load(w.lua))
            native: list[tuple[float, float]] = []
            script: list[tuple[float, float]] = []
            for _ in range(rounds):  # A B A B ...: drift hits both variants alike
                native.append(run(r, w, n, depth, None))
                script.append(run(r, w, n, depth, sha))
            rows.append(
                Row(
                    label,
                    w.name,
                    statistics.median(x[0] for x in native),
                    statistics.median(x[0] for x in script),
                    statistics.median(x[1] for x in native),
                    statistics.median(x[1] for x in script),
                )
            )
            print(f"  {label:14} {w.name:24} done", file=sys.stderr)
    return rows


def table(rows: list[Row]) -> str:
    lines = [
        "| server | command | native ops/s | EVALSHA ops/s | native usec/call "
        "| EVALSHA usec/call | script/native (server time) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.server} | {row.workload} | {row.native_ops:,.0f} | {row.script_ops:,.0f} "
            f"| {row.native_usec:.2f} | {row.script_usec:.2f} | {row.ratio:.1f}x |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--ops", type=int, default=50_000, help="calls per variant per round")
    parser.add_argument("--depth", type=int, default=50, help="pipeline depth")
    parser.add_argument("--rounds", type=int, default=3, help="native/script alternations")
    parser.add_argument("--servers", default="redis,valkey", help="comma-separated kinds")
    args = parser.parse_args(argv)

    module = build_module()
    rows: list[Row] = []
    for kind in args.servers.split(","):
        rows += bench(kind, module, args.ops, args.depth, args.rounds)
    print(
        f"{args.ops} calls per variant, pipeline depth {args.depth}, "
        f"median of {args.rounds} alternating rounds\n"
    )
    print(table(rows))
    slow = [r for r in rows if r.ratio < 1.5]
    if slow:
        print("\nbelow the 1.5x target: " + ", ".join(f"{r.server} {r.workload}" for r in slow))
        return 1
    return 0


if __name__ == "__main__":
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # for tests.support
    sys.exit(main())
