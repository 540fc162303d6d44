"""Reads that must see the last write, on a 3-node cluster with R3 streams, after the leaders moved.

NATS promises no read-your-writes for direct gets: with replicas one may be answered by a follower that has
not applied the newest write yet. Measured on this machine (writer on node 0, reader on node 2, after the
node leading the streams was killed and restarted): 1-7% of direct KV reads made right after an acked put
returned the previous value. A stale issue window made the trainer refuse trajectories of issued groups
(their admission credit lost: the run stalled), and a replay cut short by a lagging replica would hide a
restarted trainer's lost step. Here every read the actors rely on is made right after the write it must
see, many times, through a node that is not the leader: :meth:`Bus.get_int` (a leader read) and
:func:`stored_messages` (direct gets, the end confirmed by the leader) must never be behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.js.errors import APIError

from miles.bus.client import Bus
from miles.bus.cluster import NatsCluster
from miles.bus.follow import stored_messages
from miles.bus.setup import setup_run
from miles.config import BusConfig

pytestmark = pytest.mark.slow

RUN = "consist"
ROUNDS = 300  # per phase; at 1% stale, a direct read would be behind at least once with p > 0.95
KEY = "consistency_probe"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    with NatsCluster(tmp_path / "hub") as hub:
        yield hub


def bus_config() -> BusConfig:
    return BusConfig(replicas=3, outage_budget_s=30.0)


async def check_reads_after_writes(writer: Bus, reader: Bus, phase: str, start: int) -> int:
    """``ROUNDS`` writes, each read back at once through ``reader``: a KV value and a replay of EVENTS."""
    events = reader.subjects.events_stream
    subject = f"{RUN}.events.probe"
    for i in range(start, start + ROUNDS):
        await writer.put_int(KEY, i)  # the bus's retry layer rides out the leader election
        assert await reader.get_int(KEY, -1) == i, f"{phase}: the state bucket read behind the put of {i}"
        ack = await writer.js.publish(subject, str(i).encode())
        replayed = [m async for m in stored_messages(reader.js, events, subject, after_seq=ack.seq - 1)]
        assert [m.data for m in replayed] == [str(i).encode()], f"{phase}: the replay ended before seq {ack.seq}"
    return start + ROUNDS


def test_state_reads_and_replays_see_the_last_write_after_the_leaders_moved(cluster: NatsCluster) -> None:
    async def scenario() -> None:
        cfg = bus_config()
        await setup_run(cfg, cluster.url, RUN)
        writer = await Bus.open(cfg, cluster.node_url(0), RUN, "writer")
        reader = await Bus.open(cfg, cluster.node_url(2), RUN, "reader")
        try:
            n = await check_reads_after_writes(writer, reader, "steady", 0)
            # Node 1 leads both streams (the test's own connections are on 0 and 2), then is lost.
            lost = 1
            for stream in (f"KV_{writer.subjects.state_bucket}", writer.subjects.events_stream):
                await move_leader(writer, stream, cluster.nodes[lost].server_name)
            cluster.kill(lost)
            n = await check_reads_after_writes(writer, reader, f"node {lost} lost", n)
            cluster.nodes[lost]._spawn()  # it rejoins behind: reads start while it catches up
            n = await check_reads_after_writes(writer, reader, f"node {lost} rejoining", n)
            via = await Bus.open(cfg, cluster.node_url(lost), RUN, "reader-on-rejoined")
            try:
                await check_reads_after_writes(writer, via, f"through node {lost}", n)
            finally:
                await via.close()
        finally:
            await reader.close()
            await writer.close()

    asyncio.run(scenario())


async def move_leader(bus: Bus, stream: str, node: str) -> None:
    """Make ``node`` the leader of ``stream`` (a leader step-down with a preferred successor)."""
    request = json.dumps({"placement": {"preferred": node}}).encode()
    deadline = time.monotonic() + 30
    while (await bus.js.stream_info(stream)).cluster.leader != node:  # type: ignore[union-attr]
        if time.monotonic() > deadline:
            raise AssertionError(f"{stream}: {node} did not become its leader")
        with contextlib.suppress(APIError, asyncio.TimeoutError):
            await bus.js._api_request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", request)
        await asyncio.sleep(0.5)
