"""Command line: `python -m goblin_idem <command>` (build-module, inspect, forget, sql purge,
postgres-ddl)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import _options as options
from ._forget import forget
from ._log import describe
from .exceptions import InFlightError
from .inspection import SCOPE_ENV, KeyState, format_state, inspect_key, names_for_hash
from .store import RedisStore

if TYPE_CHECKING:
    from .sql import SqlRecords

__all__ = ["main"]


def _build_module(args: argparse.Namespace) -> int:
    from .native import build_module

    try:
        path = build_module(args.out, cc=args.cc)
    except RuntimeError as exc:
        return _failed(exc, 1)
    # The path is the last line of output, so scripts can take it with `tail -n 1`.
    print(path)
    return 0


def _failed(message: object, status: int) -> int:
    """Say what went wrong on stderr; `status` is the command's exit status."""
    print(f"error: {message}", file=sys.stderr)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m goblin_idem")
    sub = parser.add_subparsers(dest="command", required=True)

    build = sub.add_parser(
        "build-module",
        help="compile the GOBLIN.* server module and print the path of the .so",
    )
    build.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="output directory (default: a per-user cache directory keyed by the source)",
    )
    build.add_argument(
        "--cc", metavar="COMPILER", default=None, help="C compiler to use (default: $CC or cc)"
    )
    build.set_defaults(func=_build_module)

    _add_inspect(sub)
    _add_forget(sub)
    _add_sql(sub)
    _add_postgres_ddl(sub)

    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


def _add_inspect(subparsers: Any) -> argparse.ArgumentParser:
    """Add `inspect` to the subcommands; it dispatches to `_inspect`."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "inspect",
        help="show an Idempotency-Key's state in the store (free, in flight, completed)",
        description=(
            "Show what the store holds for one Idempotency-Key: free, in flight (lease left "
            "and owner token), or completed (TTL, stored status, headers and body size)."
        ),
    )
    _add_key_arguments(parser, "inspect")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--reveal",
        action="store_true",
        help="show a sealed record's headers (opened with $GOBLIN_IDEM_ENCRYPTION_KEYS)",
    )
    parser.add_argument(
        "--require-sealed",
        action="store_true",
        help="show a record in the clear as a middleware with require_sealed=True answers it",
    )
    parser.set_defaults(func=_inspect)
    return parser


def _add_key_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    """How `inspect` and `forget` name a key: KEY in --scope and --namespace, or --hash."""
    parser.add_argument("key", nargs="?", help="the Idempotency-Key as the client sent it")
    parser.add_argument(
        "--hash",
        dest="key_hash",
        metavar="HASH",
        help=f"{verb} by the key hash that log lines print, instead of by KEY",
    )
    parser.add_argument(
        "--url",
        default=os.environ.get("REDIS_URL"),
        help="the store, e.g. redis://127.0.0.1:6380/0 (default: $REDIS_URL)",
    )
    parser.add_argument(
        "--scope",
        default=None,
        help=(
            "the scope the middleware keyed the request by: by default the request's "
            "Authorization header value (empty for anonymous callers). A secret given "
            "here shows in the process list and the shell history: give - to read it "
            f"from stdin, or set ${SCOPE_ENV} (the default when --scope is not given)"
        ),
    )
    parser.add_argument(
        "--namespace",
        default="idem",
        help=(
            "key prefix (default: idem, the middleware's and its webhook routes'; once and "
            "the broker consumers: once; gRPC calls: grpc, with --hash from on_event)"
        ),
    )


def _scope(given: str | None) -> str:
    """--scope's value; ``-`` reads one line from stdin; absent, $GOBLIN_SCOPE or empty."""
    if given == "-":
        return sys.stdin.readline().removesuffix("\n").removesuffix("\r")
    if given is not None:
        return given
    return os.environ.get(SCOPE_ENV, "")


async def _inspect_url(store: RedisStore, args: argparse.Namespace, scope: str) -> KeyState:
    names = names_for_hash(args.key_hash, namespace=args.namespace) if args.key_hash else None
    try:
        return await inspect_key(
            store,
            args.key,
            scope=scope,
            namespace=args.namespace,
            names=names,
            sealer=options.sealer(None),
            reveal=args.reveal,
            require_sealed=args.require_sealed,
        )
    finally:
        await store.aclose()


def _store_of(args: argparse.Namespace) -> RedisStore | None:
    """The store the arguments name, with KEY or --hash given; else None, said why."""
    if args.url is None:
        print("error: give --url redis://host:port/db (or set REDIS_URL)", file=sys.stderr)
        return None
    if (args.key is None) == (args.key_hash is None):
        print("error: give either KEY or --hash HASH", file=sys.stderr)
        return None
    try:
        # one command and out: no replay cache, so no tracking handshake either
        return RedisStore.from_url(args.url, max_connections=2, replay_cache_bytes=0)
    except ValueError as exc:  # a malformed URL
        print(f"error: {exc}", file=sys.stderr)
        return None


def _inspect(args: argparse.Namespace) -> int:
    store = _store_of(args)
    if store is None:
        return 2
    try:
        state = asyncio.run(_inspect_url(store, args, _scope(args.scope)))
    except ValueError as exc:
        return _failed(exc, 2)
    except Exception as exc:  # the store is unreachable or answered an error
        return _failed(f"could not read the store at {store.address}: {describe(exc)}", 1)
    print(json.dumps(state.as_dict(), indent=2) if args.json else format_state(state))
    return 0


def _add_forget(subparsers: Any) -> None:
    """Add `forget`: remove a key's claim, stored response and SQL record (`_forget`)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "forget",
        help="remove an Idempotency-Key's claim, stored response and SQL record",
        description=(
            "Remove what answers one Idempotency-Key (its SQL record with --database-url, "
            "its stored response, its claim), so that the next request with it runs the "
            "handler again. A key in flight is refused: wait for its run to end. Give "
            "--database-url, or --store-only for an app that keeps no SQL records."
        ),
    )
    _add_key_arguments(parser, "forget")
    _add_records_arguments(parser, "--database-url")
    parser.add_argument(
        "--store-only",
        action="store_true",
        help="the app keeps no SQL records: forget the key in the store alone",
    )
    parser.set_defaults(func=_forget)


def _add_records_arguments(parser: argparse.ArgumentParser, flag: str) -> None:
    """Where SQL records are: the database URL (`flag`, default $DATABASE_URL), the table."""
    parser.add_argument(
        flag,
        dest="database_url",
        default=os.environ.get("DATABASE_URL"),
        help="SQLAlchemy async URL, e.g. postgresql+asyncpg://user@host/db (default: "
        "$DATABASE_URL)",
    )
    parser.add_argument(
        "--table", default=None, help="the records table (default: goblin_idem_records)"
    )


def _records(args: argparse.Namespace) -> SqlRecords:
    """The SqlRecords the arguments name; ImportError saying what to install without the
    `sql` extra, TypeError or ValueError for a URL it refuses."""
    try:
        from .sql import SqlRecords
        from .sql._table import DEFAULT_TABLE
    except ImportError as exc:
        raise ImportError(f"{exc}: install goblin-idem[sql]") from None
    return SqlRecords(args.database_url, table=args.table or DEFAULT_TABLE)


async def _forget_url(store: RedisStore, args: argparse.Namespace, scope: str) -> bool:
    records = _records(args) if args.database_url else None
    names = names_for_hash(args.key_hash, namespace=args.namespace) if args.key_hash else None
    try:
        if records is not None:
            await records.check()
        return await forget(
            store, args.key, scope=scope, namespace=args.namespace, names=names, records=records
        )
    finally:
        await store.aclose()
        if records is not None:
            await records.aclose()


def _forget(args: argparse.Namespace) -> int:
    # The store cannot tell whether the app keeps SQL records: forgetting it alone there
    # would print "forgotten" while the record goes on answering the key.
    if args.store_only and args.database_url:
        return _failed("give either --database-url or --store-only, not both", 2)
    if not args.store_only and not args.database_url:
        return _failed(
            "give --database-url (or set DATABASE_URL) so that the key's SQL record goes "
            "too, or --store-only if the app keeps no SQL records: with records, the store "
            "alone forgotten leaves the record answering the key. Nothing was removed",
            2,
        )
    store = _store_of(args)
    if store is None:
        return 2
    try:
        removed = asyncio.run(_forget_url(store, args, _scope(args.scope)))
    except (ImportError, TypeError, ValueError) as exc:
        return _failed(exc, 2)
    except InFlightError as exc:
        return _failed(exc, 1)
    except Exception as exc:  # the store or the database is unreachable, or refused
        return _failed(f"could not forget the key: {describe(exc)}", 1)
    print("forgotten" if removed else "nothing was stored for this key")
    return 0


def _add_sql(subparsers: Any) -> None:
    """Add `sql purge`: delete the expired rows of SQL records (goblin_idem.sql)."""
    sql = subparsers.add_parser("sql", help="SQL records in the app's database")
    commands = sql.add_subparsers(dest="sql_command", required=True)
    purge = commands.add_parser(
        "purge",
        help="delete expired records, in bounded batches; prints how many",
        description=(
            "Delete the records whose expiry has passed (never replayed any more), a "
            "batch per transaction, and print how many were deleted."
        ),
    )
    _add_records_arguments(purge, "--url")
    purge.add_argument("--batch", type=int, default=1000, help="rows per transaction (1000)")
    purge.set_defaults(func=_purge)


def _purge(args: argparse.Namespace) -> int:
    if args.database_url is None:
        return _failed("give --url (or set DATABASE_URL)", 2)
    try:
        records = _records(args)
    except (ImportError, TypeError, ValueError) as exc:
        return _failed(exc, 2)

    async def purge() -> int:
        try:
            await records.check()
            return await records.purge_expired(args.batch)
        finally:
            await records.aclose()

    try:
        deleted = asyncio.run(purge())
    except Exception as exc:
        return _failed(describe(exc), 1)
    print(deleted)
    return 0


def _add_postgres_ddl(subparsers: Any) -> None:
    """Add `postgres-ddl`: PostgresStore's table, for those who migrate with their own tools."""
    parser = subparsers.add_parser(
        "postgres-ddl",
        help="print the SQL that creates PostgresStore's table (what create_table() runs)",
    )
    parser.add_argument(
        "--table", default="goblin_idem_keys", help="table name (default: goblin_idem_keys)"
    )
    parser.set_defaults(func=_postgres_ddl)


def _postgres_ddl(args: argparse.Namespace) -> int:
    from .store._postgres_sql import ddl

    try:
        print(ddl(args.table), end="")
    except ValueError as exc:
        return _failed(exc, 2)
    return 0
