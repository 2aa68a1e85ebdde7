"""The Redis store's way to its servers: the hot path's script calls, one by one or
batched into pipelines per server (per slot's primary, on a cluster), ``WAIT`` after a
write, and a cluster's redirects and slot map.

Part of :mod:`asgi_idempotency.stores.redis`: :class:`RedisPipelines` is the store's
base, with the state the store's ``__init__`` sets.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Sequence
from typing import Any

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.stores.base import StoreBase
from asgi_idempotency.stores.batching import Batcher, BatchStats
from asgi_idempotency.stores.redis_client import (
    _REDIRECTED,
    DRIVER_ERRORS,
    REDIS_ERRORS,
    AsyncScript,
    RedisCluster,
    _call,
    _Client,
    aioredis,
    rexc,
)

__all__ = ["MAX_BATCH", "RedisPipelines"]

# Requests per pipeline, at most, by default (as SQLStore's MAX_BATCH).
MAX_BATCH = 256


# One script call for a pipeline: (script, record key, arguments, payload bytes for the
# batcher's max_bytes). A plain tuple: built on every request, where a NamedTuple's
# __new__ is a Python call.
_Op = tuple[AsyncScript, str, Sequence[Any], int]


def _op_key(op: _Op) -> str:
    return op[1]


def _op_size(op: _Op) -> int:
    return op[3]


async def _pipe(target: aioredis.Redis, batch: Sequence[_Op]) -> list[Any]:
    """One pipeline (no MULTI) of ``batch``'s script calls; a command's error reply is
    its entry in the result rather than raised, so it fails that request alone."""
    pipe = target.pipeline(transaction=False)
    for op in batch:
        pipe.execute_command("EVALSHA", op[0].sha, 1, op[1], *op[2])
    replies: list[Any] = await pipe.execute(raise_on_error=False)
    return replies


class RedisPipelines(StoreBase):
    """The store's calls to its servers (:class:`~asgi_idempotency.stores.redis.RedisStore`
    sets this state in its ``__init__``)."""

    client: _Client
    batching: bool
    _timeout: float | None
    _cold: bool
    _warming: asyncio.Lock
    _refreshing: asyncio.Lock
    _prefix: str
    _wait: int
    _wait_ms: int
    _max_batch: int
    _batchers: dict[str, Batcher[_Op, Any]]
    _node_clients: dict[str, aioredis.Redis]

    def _encoder(self) -> Any:
        if isinstance(self.client, RedisCluster):
            return self.client.get_encoder()
        return self.client.connection_pool.get_encoder()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated

    def _key(self, key: str) -> str:
        return f"{self._prefix}{key}}}"

    def _scoped(self, name: bytes) -> str:
        return name.decode()[len(self._prefix) : -1]

    async def _warm(self) -> None:
        async with self._warming:
            if self._cold:
                assert isinstance(self.client, RedisCluster)
                await _call(self.client.initialize(), self._timeout)
                self._cold = False

    async def _demoted(self) -> None:
        """``READONLY``: the server this client reached is a replica now (a failover
        demoted it, and a DNS name or virtual IP may already lead to the new primary).
        To the store that is a broken connection: the pool's idle connections, the one
        that met it among them, are dropped, so the next command connects afresh. The
        request still gets 503: its command did not run. (A client from
        ``Sentinel.master_for`` does this itself, asking the Sentinels again.)"""
        client = self.client
        if isinstance(client, RedisCluster):
            return  # the cluster client follows the slot map: MOVED, not READONLY
        with contextlib.suppress(*DRIVER_ERRORS):
            await client.connection_pool.disconnect(inuse_connections=False)

    def _batcher(self, rkey: str) -> Batcher[_Op, Any]:
        """The batcher of ``rkey``'s server: the one server's, or its slot's primary's."""
        client = self.client
        name = ""
        if isinstance(client, RedisCluster):
            # No node for the slot (a map mid-change): such a batch goes by the cluster
            # client, command by command (_send).
            node = client.get_node_from_key(rkey)
            name = "?" if node is None else node.name
        batcher = self._batchers.get(name)
        if batcher is None:
            batcher = self._batchers[name] = Batcher(
                functools.partial(self._pipeline, name),
                key=_op_key,
                # Redis runs a pipeline's scripts one after another, each atomic, in the
                # order sent (arrival order): a second operation on a key in the same
                # pipeline sees what the first did, as in a command of its own just after.
                distinct=False,
                max_size=self._max_batch,
                size=_op_size,
                # A request that finds the server idle is sent from its own task, as
                # without batching: no task, future and loop pass of the batcher's, so
                # a lone request costs what it did. Cancelling it is then what it was
                # without batching (a claim's is the lifecycle's orphaned callback's).
                inline=self._alone,
            )
        return batcher

    @property
    def batch_stats(self) -> BatchStats:
        """Pipelines sent and script calls they carried, over every server (this loop's)."""
        total = BatchStats()
        for batcher in self._batchers.values():
            total.statements += batcher.stats.statements
            total.operations += batcher.stats.operations
            total.largest = max(total.largest, batcher.stats.largest)
        return total

    def _alone(self, op: _Op) -> Awaitable[Any]:
        # Within the caller's own deadline (_run); no loop pass before the send: the
        # request found nothing to wait for.
        return self._evalsha(op[0], op[1], op[2], pause=False)

    async def _pipeline(self, node: str, batch: list[_Op]) -> list[Any]:
        """Send ``batch`` to its server: alone, as the one command; else one pipeline.

        Returns each command's reply, or the error reply it got (a ``ResponseError``),
        for its waiter to raise. Raises :class:`StoreError` when the pipeline as a whole
        failed (unreachable, timed out): every request in it then fails.
        """
        if len(batch) == 1:
            # Alone: what an unbatched request sends, through the client that follows
            # redirects; no loop pass first (the batcher's task was one).
            script, rkey, args, _ = batch[0]
            return [await _call(self._evalsha(script, rkey, args, pause=False), self._timeout)]
        client = self.client
        target: aioredis.Redis | None
        if isinstance(client, RedisCluster):
            # A plain pipeline on the primary's own connection: the batch is one node's
            # by construction, and a redirected command is re-sent on its own below.
            found = client.get_node(node_name=node)
            target = None if found is None else self._node_client(found)
        else:
            target = client
        return await _call(self._send(target, batch), self._timeout)

    async def _send(self, target: aioredis.Redis | None, batch: list[_Op]) -> list[Any]:
        cluster = self.client if isinstance(self.client, RedisCluster) else None
        if target is None:  # the node left the map since the batch was queued
            replies: list[Any] = [rexc.MovedError("0 node-left:0")] * len(batch)
        else:
            try:
                replies = await _pipe(target, batch)
                lost = [i for i, r in enumerate(replies) if isinstance(r, rexc.NoScriptError)]
                if lost:
                    # A flushed or restarted server: load what it lost, send those again
                    # (they did not run).
                    for script in {id(batch[i][0]): batch[i][0] for i in lost}.values():
                        script.sha = await target.script_load(script.script)
                    again = await _pipe(target, [batch[i] for i in lost])
                    for i, reply in zip(lost, again, strict=True):
                        replies[i] = reply
            except (rexc.ConnectionError, rexc.TimeoutError, OSError):
                if cluster is not None:
                    await self._refresh_slots(cluster)  # a dead or demoted node
                raise
        if cluster is not None:
            moved = [i for i, reply in enumerate(replies) if isinstance(reply, _REDIRECTED)]
            if moved:
                await self._refresh_slots(cluster, wait=True)
                for i in moved:  # in the order sent, so one key's operations stay in order
                    script, rkey, args, _ = batch[i]
                    try:
                        replies[i] = await self._evalsha(script, rkey, args, pause=False)
                    except StoreError as exc:
                        replies[i] = exc.__cause__ or exc
        return replies

    async def _evalsha(
        self, script: AsyncScript, rkey: str, args: Sequence[Any], *, pause: bool = True
    ) -> Any:
        # What AsyncScript.__call__ does, without its three layers of calls (evalsha,
        # _evalsha), tuple copies and per-call import: EVALSHA, and on NOSCRIPT (a
        # flushed or restarted server) SCRIPT LOAD and once more.
        execute = self.client.execute_command
        # One loop pass before the send: the requests that became ready in this pass
        # send their commands together, so redis-server wakes once for several and the
        # replies come back in one poll. Without it each send woke the server on its own
        # (measured in docs/performance.md). Cancelled here, nothing has been sent.
        if pause:
            await asyncio.sleep(0)
        try:
            try:
                return await execute("EVALSHA", script.sha, 1, rkey, *args)
            except rexc.NoScriptError:
                script.sha = await self.client.script_load(script.script)
                return await execute("EVALSHA", script.sha, 1, rkey, *args)
        except REDIS_ERRORS.errors as exc:
            # Here as well as in _call: a lone batched request is sent from here with no
            # _call of its own around it (its caller's deadline is the bound).
            raise REDIS_ERRORS.translate(exc) from exc

    async def _run_and_wait(self, script: AsyncScript, key: str, args: Sequence[Any]) -> Any:
        # WAIT counts the replicas that have *this connection's* writes, so it must go on
        # the connection that ran the script: both in one pipeline, one round trip. On a
        # cluster that is a plain pipeline to the key's primary: a cluster pipeline
        # re-sends a redirected or failed command on its own, and the WAIT would then
        # count another connection's writes.
        rkey, cluster = self._key(key), self.client
        target: aioredis.Redis
        if isinstance(cluster, RedisCluster):
            await cluster.initialize()  # fills the slot map on first use; else a no-op
            target = self._node_client(cluster.get_node_from_key(rkey))
        else:
            target = cluster
        followed = False
        try:
            while True:
                pipe = target.pipeline(transaction=False)
                # EVAL with the script's text, never EVALSHA: a server that lacks the
                # script (a replica just promoted by a failover, a restart) would answer
                # NOSCRIPT, and the WAIT pipelined behind it would still block for its
                # whole timeout when no replica is attached, before the reload and the
                # second try; every write that meets a fresh primary paid it. The text
                # costs bytes on a path that already waits for replication.
                pipe.execute_command("EVAL", script.script, 1, rkey, *args)
                pipe.execute_command("WAIT", self._wait, self._wait_ms)
                try:
                    result, acked = await pipe.execute()
                except rexc.MovedError as moved:
                    # The slot has another primary now (a failover, a resharding) and
                    # this node ran nothing: send it once more, to the primary a fresh
                    # map names, as the cluster client does for its own commands. Still
                    # inside the call's deadline (_run); a second MOVED is a 503.
                    if followed or not isinstance(cluster, RedisCluster):
                        raise
                    followed = True
                    target = await self._moved_to(cluster, rkey, moved)
                    continue
                if int(acked) < self._wait:
                    raise StoreError(
                        f"WAIT: {acked} of {self._wait} replicas acknowledged the write "
                        f"within {self._wait_ms} ms"
                    )
                return result
        except (rexc.ConnectionError, rexc.TimeoutError, rexc.ResponseError, OSError):
            if isinstance(cluster, RedisCluster):
                await self._refresh_slots(cluster)  # MOVED, a dead node: the map is stale
            raise

    async def _moved_to(
        self, cluster: RedisCluster, rkey: str, moved: rexc.MovedError
    ) -> aioredis.Redis:
        """The client of ``rkey``'s primary after ``moved``, with the slot map refreshed.

        The address the MOVED names is the server's own answer, so it wins over a map
        read from a node that may not have learnt the change yet; the map's node serves
        when the MOVED names a node the map does not know.
        """
        await self._refresh_slots(cluster, wait=True)
        node = cluster.get_node(host=moved.host, port=moved.port)
        if node is None:
            # A node the map did not have: the refresh waited for may have begun before
            # the slot moved, so ask once more.
            await self._refresh_slots(cluster, wait=True)
            node = cluster.get_node(host=moved.host, port=moved.port)
        if node is None:
            node = cluster.get_node_from_key(rkey)
        if node is None:
            raise moved
        return self._node_client(node)

    def _node_client(self, node: Any) -> aioredis.Redis:
        """A plain client of one cluster node, built from that node's own settings."""
        client = self._node_clients.get(node.name)
        if client is None:
            pool = aioredis.ConnectionPool(
                connection_class=node.connection_class, **node.connection_kwargs
            )
            client = self._node_clients[node.name] = aioredis.Redis(connection_pool=pool)
        return client

    async def _refresh_slots(self, cluster: RedisCluster, *, wait: bool = False) -> None:
        """Ask a node for the slot map again; ``wait``: return only once a refresh has
        ended (the one already in flight, if any), for a caller about to use the map."""
        if self._refreshing.locked():
            if wait:
                async with self._refreshing:
                    pass  # the refresh in flight has ended: its map is the one to read
            return  # another request is already asking
        # Mid-failover it may fail too: the next request asks again.
        async with self._refreshing:
            with contextlib.suppress(*DRIVER_ERRORS):
                await cluster.nodes_manager.initialize()
