"""Trajectories and weight payloads through a leaf node against one server, side by side in one run.

    python benchmarks/leaf.py --trajectories 2000 --traj-kb 8 --size-mb 64 --repeats 4

Two topologies, both running at once on loopback (open variant: no TLS, no per-role logins; the order
alternates between repeats):

* ``one server``: one nats-server with JetStream; the "worker" and the "trainer" clients both connect to it;
* ``leaf``: a hub nats-server (JetStream domain ``hub``) and a leaf node without JetStream that maps its
  clients' JetStream requests to the hub's domain (``default_js_domain``, deploy/nats/leafnode.conf); the
  worker connects to the leaf, the trainer to the hub: what a remote fleet's worker does.

The run's real streams are created (``ensure_run_streams``). Measured, per repeat:

* trajectory throughput: ``--publishers`` worker tasks publish ``--trajectories`` messages of ``--traj-kb``
  to the TRAJ stream, each awaiting its ack (as a rollout worker does), while the trainer pulls them through
  its durable consumer (batches of 64, acked); trajectories per second from the first publish to the last
  ack, and the median publish-to-ack latency;
* weight sync: the trainer puts a ``--size-mb`` payload into the data plane (``WeightStore.put``) and the
  worker fetches and verifies it (``WeightStore.get``, the default reader); seconds of the get.

Prints medians over ``--repeats`` and the ratios leaf / one server; ``--json PATH`` writes everything with the
host's load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog

from miles.bus.connect import connect, processed
from miles.bus.server import DEFAULT_MAX_PAYLOAD, EmbeddedNats
from miles.bus.streams import ensure_run_streams
from miles.bus.subjects import Subjects
from miles.ports import free_port
from miles.sync.transport.dataplane import CHUNK_HEADROOM, WeightStore

RUN = "bench"
MiB = 1024 * 1024


def start_one_server(root: Path) -> tuple[list[EmbeddedNats], str, str]:
    server = EmbeddedNats(root / "one").start_sync()
    return [server], server.url, server.url


def start_leaf(root: Path) -> tuple[list[EmbeddedNats], str, str]:
    leaf_port = free_port()
    hub = EmbeddedNats(
        root / "hub", js_domain="hub", extra_config=f'leafnodes {{ listen: "127.0.0.1:{leaf_port}" }}\n'
    ).start_sync()
    leaf_conf = (
        'default_js_domain: { "$G": "hub" }\n'
        f'leafnodes {{ remotes: [ {{ urls: ["nats-leaf://127.0.0.1:{leaf_port}"] }} ] }}\n'
    )
    leaf = EmbeddedNats(root / "leaf", jetstream=False, server_name="leaf", extra_config=leaf_conf).start_sync()
    deadline = time.monotonic() + 30
    while hub.varz().get("leafnodes", 0) < 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the leaf link did not come up: {leaf.log_path}")
        time.sleep(0.05)
    time.sleep(0.3)  # the interest the link carries is exchanged
    return [hub, leaf], hub.url, leaf.url


async def trajectories(worker_url: str, trainer_url: str, n: int, size: int, publishers: int) -> dict[str, float]:
    s = Subjects(RUN)
    worker, trainer = await connect(worker_url, name="worker"), await connect(trainer_url, name="trainer")
    try:
        wjs, tjs = worker.jetstream(), trainer.jetstream()
        await tjs.purge_stream(s.traj_stream)
        sub = await tjs.pull_subscribe_bind(durable=s.TRAINER_CONSUMER, stream=s.traj_stream)
        payload = os.urandom(size)
        latencies: list[float] = []

        async def publish(count: int) -> None:
            for _ in range(count):
                t = time.perf_counter()
                await wjs.publish(s.traj, payload)
                latencies.append(time.perf_counter() - t)

        async def consume() -> None:
            got = 0
            while got < n:
                msgs = await sub.fetch(64, timeout=30)
                for msg in msgs:
                    await msg.ack()
                got += len(msgs)
            await processed(trainer)

        start = time.perf_counter()
        consumer = asyncio.create_task(consume())
        share = [n // publishers + (1 if i < n % publishers else 0) for i in range(publishers)]
        await asyncio.gather(*(publish(c) for c in share))
        await consumer
        elapsed = time.perf_counter() - start
        await sub.unsubscribe()
        return {"traj_per_s": n / elapsed, "publish_ack_ms": 1000 * statistics.median(latencies)}
    finally:
        await worker.close()
        await trainer.close()


async def weight_sync(worker_url: str, trainer_url: str, size: int, version: int) -> dict[str, float]:
    worker, trainer = await connect(worker_url, name="worker"), await connect(trainer_url, name="trainer")
    try:
        chunk = DEFAULT_MAX_PAYLOAD - CHUNK_HEADROOM
        put_store = WeightStore(trainer.jetstream(), RUN, chunk_bytes=chunk, keep_versions=2)
        get_store = WeightStore(worker.jetstream(), RUN, chunk_bytes=chunk, keep_versions=2)
        payload = os.urandom(size)
        t = time.perf_counter()
        await put_store.put(version, payload)
        put_s = time.perf_counter() - t
        t = time.perf_counter()
        got = await get_store.get(version)
        get_s = time.perf_counter() - t
        assert len(got) == size
        return {"put_s": put_s, "get_s": get_s}
    finally:
        await worker.close()
        await trainer.close()


async def create_streams(trainer_url: str) -> None:
    setup = await connect(trainer_url, name="setup")
    try:
        await ensure_run_streams(setup.jetstream(), Subjects(RUN), replicas=1, ack_wait_s=30.0)
    finally:
        await setup.close()


async def measure_once(worker_url: str, trainer_url: str, args: argparse.Namespace, rep: int) -> dict[str, float]:
    traj = await trajectories(worker_url, trainer_url, args.trajectories, args.traj_kb * 1024, args.publishers)
    return traj | await weight_sync(worker_url, trainer_url, args.size_mb * MiB, rep)


async def measure(urls: dict[str, tuple[str, str]], args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Both topologies run at once; the order alternates between repeats (no first-comer advantage)."""
    for trainer_url, _ in urls.values():
        await create_streams(trainer_url)
    out: dict[str, dict[str, list[float]]] = {name: {} for name in urls}
    names = list(urls)
    for rep in range(args.repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            trainer_url, worker_url = urls[name]
            for key, value in (await measure_once(worker_url, trainer_url, args, rep)).items():
                out[name].setdefault(key, []).append(value)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trajectories", type=int, default=2000)
    p.add_argument("--traj-kb", type=int, default=8, help="Size of one trajectory message.")
    p.add_argument("--publishers", type=int, default=2, help="Worker tasks publishing at once.")
    p.add_argument("--size-mb", type=int, default=64, help="Weight payload size.")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with tempfile.TemporaryDirectory() as tmp:
        servers: list[EmbeddedNats] = []
        urls: dict[str, tuple[str, str]] = {}
        try:
            for name, start in (("one server", start_one_server), ("leaf", start_leaf)):
                started, trainer_url, worker_url = start(Path(tmp))
                servers += started
                urls[name] = (trainer_url, worker_url)
            results = asyncio.run(measure(urls, args))
        finally:
            for server in reversed(servers):
                server.stop_sync()
    med = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in results.items()}
    print(f"{'':12} {'traj/s':>9} {'pub-ack ms':>11} {'put s':>7} {'get s':>7}   ({args.size_mb} MB weights)")
    for name, m in med.items():
        print(f"{name:12} {m['traj_per_s']:9.0f} {m['publish_ack_ms']:11.2f} {m['put_s']:7.3f} {m['get_s']:7.3f}")
    ratios = {k: med["leaf"][k] / med["one server"][k] for k in med["leaf"]}
    print(
        f"{'leaf / one':12} {ratios['traj_per_s']:9.2f} {ratios['publish_ack_ms']:11.2f} "
        f"{ratios['put_s']:7.2f} {ratios['get_s']:7.2f}"
    )
    if args.json:
        record: dict[str, Any] = {"args": vars(args) | {"json": str(args.json)}, "results": results}
        record |= {"medians": med, "ratios": ratios, "loadavg": os.getloadavg()}
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
