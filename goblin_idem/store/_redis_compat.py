"""Every use of redis-py's internals, in one place, each with the releases it was checked
on (redis-py 5.0.1 to the newest the project allows; tests/store/test_redis_compat.py runs
each one, and CI runs the store tests on the oldest redis-py too).

redis-py offers no public way to do these things: reset a cluster node's pool, tell whether
a cluster client's slot table is stale, read a pool's connections, read a retry's count.
"""

from __future__ import annotations

import contextlib
import inspect
import socket
from typing import Any

import redis.asyncio
from redis._parsers.base import BaseParser
from redis.asyncio.cluster import ClusterNode, RedisCluster

__all__ = [
    "BaseParser",
    "copy_client",
    "drop_cluster_nodes",
    "drop_pool",
    "mark_cluster_closed",
    "retries",
    "shut_down",
    "slots_stale",
    "startup_nodes",
]


def slots_stale(client: RedisCluster) -> bool:
    """Whether the cluster client flagged its slot table stale, or has not read it yet
    (`RedisCluster._initialize`), so that `initialize()` must run before routing."""
    return bool(client._initialize)


def mark_cluster_closed(client: RedisCluster) -> None:
    """Mark a cluster client closed without awaiting `aclose`, for one whose connections
    were dropped with its closed event loop: redis-py logs "Unclosed RedisCluster client"
    for a cluster client collected while initialized, which it tells by `_initialize`
    before 8.2 and by the nodes manager's default node from 8.2 on (`aclose` clears both)."""
    client._initialize = True
    client.nodes_manager.default_node = None  # type: ignore[assignment]


def startup_nodes(client: RedisCluster) -> list[Any]:
    return list(client.nodes_manager.startup_nodes.values())


def retries(retry: object) -> int:
    """A redis-py Retry's count (`get_retries()` is missing before redis-py 5.1)."""
    return int(getattr(retry, "_retries", 0))


def drop_cluster_nodes(client: RedisCluster) -> list[object]:
    """Empty every cluster node's pool (a node's `_connections` and `_free`); the dropped
    connections."""
    dropped: list[object] = []
    nodes = {id(n): n for n in (*client.get_nodes(), *startup_nodes(client))}
    for node in nodes.values():
        connections = getattr(node, "_connections", None)
        if isinstance(connections, list):
            dropped += connections
            node._connections = []
            node._free.clear()
    return dropped


def drop_pool(client: redis.asyncio.Redis) -> list[object]:
    """Empty a single server's pool (and a single_connection_client's connection)."""
    pool = client.connection_pool
    dropped: list[object] = [
        *getattr(pool, "_available_connections", ()),
        *getattr(pool, "_in_use_connections", ()),
    ]
    pool.reset()  # type: ignore[no-untyped-call]
    if getattr(client, "connection", None) is not None:  # single_connection_client
        dropped.append(client.connection)
        client.connection = None
    return dropped


def shut_down(connection: object) -> None:
    """Shut the socket of a dropped connection (an AutoPipeline's, or redis-py's) down,
    without a call into its event loop. uvloop closes its sockets with its loop."""
    transport = getattr(connection, "transport", None)
    if transport is None:  # redis-py's keeps its transport in its stream writer
        transport = getattr(getattr(connection, "_writer", None), "transport", None)
    sock = None if transport is None else transport.get_extra_info("socket")
    if sock is not None and sock.fileno() >= 0:
        with contextlib.suppress(OSError):  # already closed by the server
            sock.shutdown(socket.SHUT_RDWR)


def copy_client(client: Any) -> Any:
    """A client with `client`'s connection settings and no connection yet, for another
    event loop: redis-py's pools, connections and locks belong to the loop that first
    used them.

    A single server's client gets a pool of the same class and settings; a cluster client
    a new one from its startup nodes, connection settings and the cluster options redis-py
    keeps (full coverage, replicas, remapping, retries). A pool of another kind (Sentinel's)
    cannot be copied: TypeError, which says to make one store per event loop.
    """
    if isinstance(client, RedisCluster):
        return _copy_cluster(client)
    pool = client.connection_pool
    pools = (redis.asyncio.ConnectionPool, redis.asyncio.BlockingConnectionPool)
    if type(pool) not in pools:
        raise TypeError(
            f"a RedisStore over a {type(pool).__name__} serves one event loop only: it "
            "cannot open connections of its own in another one. Make one store per event "
            "loop (each with its own client)"
        )
    extra = (
        {"timeout": pool.timeout} if isinstance(pool, redis.asyncio.BlockingConnectionPool) else {}
    )
    copy = type(pool)(
        connection_class=pool.connection_class,
        max_connections=pool.max_connections,
        **extra,
        **pool.connection_kwargs,
    )
    other = type(client)(
        connection_pool=copy, single_connection_client=client.single_connection_client
    )
    other.response_callbacks.update(client.response_callbacks)
    return other


def _copy_cluster(client: RedisCluster) -> RedisCluster:
    settings: dict[str, Any] = dict(client.get_connection_kwargs())
    settings["ssl"] = settings.get("connection_class") is redis.asyncio.SSLConnection
    manager = client.nodes_manager
    settings.update(
        require_full_coverage=manager.require_full_coverage,
        address_remap=getattr(manager, "address_remap", None),
        dynamic_startup_nodes=getattr(manager, "_dynamic_startup_nodes", True),
        reinitialize_steps=client.reinitialize_steps,
        retry=client.retry,
    )
    strategy = getattr(client, "load_balancing_strategy", None)
    if strategy is not None:
        settings["load_balancing_strategy"] = strategy
    elif client.read_from_replicas:  # deprecated since redis-py 5.3, so only if set
        settings["read_from_replicas"] = True
    accepted = inspect.signature(type(client).__init__).parameters
    nodes = [ClusterNode(str(n.host), int(n.port)) for n in startup_nodes(client)]
    kwargs = {k: v for k, v in settings.items() if k in accepted and k != "startup_nodes"}
    return type(client)(startup_nodes=nodes, **kwargs)
