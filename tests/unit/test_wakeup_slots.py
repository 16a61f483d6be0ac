"""The wake-up subscribers' bookkeeping across close(), without a server: a wait that
races close() must not leave a subscriber (a thread, a socket, a pipe) nobody closes."""

from __future__ import annotations

import asyncio

from hotlock._config import parse_url
from hotlock.backends.wakeup import ClusterWakeups
from hotlock.backends.wakeup_async import AsyncClusterWakeups


def test_a_closed_cluster_subscriber_makes_no_node_subscriber() -> None:
    config = parse_url("redis+cluster://10.0.0.1:7000", connect_timeout=1.0, timeout=0.5)
    hubs = ClusterWakeups(config, lambda channel: ("10.0.0.1", 7000))
    hubs.close()
    # The wait that fetched this object before close() ran: it polls instead.
    assert hubs.join(b"hotlock:wake:{k}") is None
    assert not hubs._nodes


def test_a_closed_async_cluster_subscriber_makes_no_node_subscriber() -> None:
    config = parse_url("redis+cluster://10.0.0.1:7000", connect_timeout=1.0, timeout=0.5)
    hubs = AsyncClusterWakeups(config, lambda channel: ("10.0.0.1", 7000))
    asyncio.run(hubs.close())
    assert hubs.join(b"hotlock:wake:{k}") is None
    assert not hubs._nodes
