"""Prompt groups generated more than once in a finished run: read from the run's own TRAJ stream.

    python benchmarks/traj_duplicates.py STORE_DIR RUN_NAME

``STORE_DIR`` is the nats-server store of a finished run (e.g. a test's ``bus`` directory: the outage tests
leave theirs under ``--basetemp``); a server is started on it, read-only in effect. Prints how many groups have
a trajectory and which ones have several (stream sequence, worker, stored at, generation seconds). The
trainer's ``trajectories_duplicate`` counts something else: every delivery it skipped, redeliveries of one
stored trajectory (its ack lost) included.
"""

from __future__ import annotations

import asyncio
import sys
from collections import defaultdict
from pathlib import Path

import nats

from miles.bus.follow import stored_messages
from miles.bus.schema import Trajectory, decode
from miles.bus.server import EmbeddedNats
from miles.bus.subjects import Subjects


async def main(store: Path, run: str) -> None:
    with EmbeddedNats(store) as server:
        nc = await nats.connect(server.url)
        s = Subjects(run)
        seen: dict[str, list[tuple[int, str, str, float]]] = defaultdict(list)
        async for raw in stored_messages(nc.jetstream(), s.traj_stream, s.traj):
            t = decode(raw.data, Trajectory)
            when = raw.time.strftime("%H:%M:%S.%f")[:-3] if raw.time else "?"
            seen[t.group_id].append((raw.seq or 0, t.worker_id, when, round(t.gen_s, 3)))
        await nc.close()
    twice = {g: v for g, v in seen.items() if len(v) > 1}
    print(f"{len(seen)} groups, {len(twice)} generated more than once")
    for group, copies in sorted(twice.items(), key=lambda kv: kv[1][0][0]):
        print(group, copies)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))
