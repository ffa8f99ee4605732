"""Shared helpers of the DHT tests: in-process swarms on 127.0.0.1 and waiting on conditions."""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Awaitable, Callable, List, Optional

from geomesh_p2p.dht import DHTNode
from geomesh_p2p.net.identity import Identity
from geomesh_p2p.net.transport import Transport
from geomesh_p2p.net.transport_config import TransportConfig

#: one run id per test process: the envelopes of another run are refused, so a node of a DHT test in another pytest
#: worker that still pings a port it knew (a node stopped there, the port since bound by this worker's test) cannot
#: enter this worker's tables. With one shared id it did: a table with an extra contact, two DHT tests failing at
#: once in a 3-worker run (session 36)
RUN = f"dht-test-run-{os.getpid()}"


async def start_node(
    bootstrap: List[str] = (),
    *,
    run_id: str = RUN,
    client_only: bool = False,
    identity: Optional[Identity] = None,
    node_cls: type = DHTNode,
    **kwargs,
) -> DHTNode:
    """A DHT node (``node_cls``: DHTNode or a test's subclass) on its own transport (127.0.0.1, free port), joined
    through ``bootstrap``."""
    transport = Transport(
        identity or Identity.generate(), run_id, TransportConfig(host="127.0.0.1", port=0, client_only=client_only)
    )
    kwargs.setdefault("rpc_timeout_s", 2.0)
    node = node_cls(transport, **kwargs)
    if not client_only:
        await transport.start()
    try:
        await node.join(bootstrap)
    except BaseException:
        await stop_node(node)
        raise
    return node


async def stop_node(node: DHTNode) -> None:
    """Kill a node: stop its DHT tasks and its transport (its port refuses connections after this)."""
    await node.shutdown()
    await node.transport.stop(grace=0)


async def start_swarm(n: int, **kwargs) -> List[DHTNode]:
    """``n`` nodes, each joining through a random node already in the swarm."""
    nodes: List[DHTNode] = [await start_node(**kwargs)]
    for _ in range(n - 1):
        nodes.append(await start_node([random.choice(nodes).address], **kwargs))
    return nodes


async def stop_all(nodes: List[DHTNode]) -> None:
    await asyncio.gather(*(stop_node(n) for n in nodes), return_exceptions=True)


async def wait_for(
    condition: Callable[[], Awaitable[bool]], timeout: float, interval: float = 0.2, what: str = "condition"
) -> None:
    """Poll ``await condition()`` every ``interval`` s until true; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        if await condition():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)
