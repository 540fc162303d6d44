"""Small weight payloads: the raw reader's own connection against the shared nats-py connection.

    python benchmarks/small_fetch.py --size-kb 47 --gets 300

Why: ``WeightStore(fetch="raw")`` opens a connection per fetch (TCP, TLS handshake, nkey login) to land a
payload's bytes straight in their buffer. That pays off on hundreds of MB; the quickstart's payload is
47 KB, fetched once per version by every worker. This starts an embedded nats-server secured as
``miles run`` secures it (the run's credential bundle: mutual TLS, per-role nkey logins), puts one
payload, and in one run alternates gets through each reader (raw, client, raw, client, ...) as the
``rollout`` role, measuring this process's CPU and the wall time per get. It prints both and the ratios
raw/client; ``fetch="auto"`` uses the client below ``dataplane.RAW_FETCH_MIN_BYTES``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import structlog

from miles.bus.connect import connect
from miles.bus.server import EmbeddedNats
from miles.bus.setup import setup_run
from miles.config import BusConfig
from miles.security.bundle import RoleCredentials, server_config, write_bundle
from miles.sync.transport.dataplane import RAW_FETCH_MIN_BYTES, WeightStore

RUN = "smallfetch"


async def measure(url: str, bundle: Path, size: int, gets: int) -> dict[str, dict[str, float]]:
    await setup_run(BusConfig(credentials_dir=str(bundle)), url, RUN)
    trainer = await connect(url, name="trainer", extra_options=RoleCredentials.load(bundle, "trainer").nats_options())
    rollout = await connect(url, name="rollout", extra_options=RoleCredentials.load(bundle, "rollout").nats_options())
    try:
        writer = WeightStore(trainer.jetstream(), RUN, chunk_bytes=1024 * 1024, keep_versions=2)
        info = await writer.put(1, os.urandom(size))
        readers = {
            fetch: WeightStore(rollout.jetstream(), RUN, chunk_bytes=1024 * 1024, keep_versions=2, fetch=fetch)
            for fetch in ("raw", "client")
        }
        cpu: dict[str, list[float]] = {fetch: [] for fetch in readers}
        wall: dict[str, list[float]] = {fetch: [] for fetch in readers}
        for _ in range(gets):
            for fetch, store in readers.items():  # interleaved: drifting load hits both alike
                c0, w0 = time.process_time(), time.perf_counter()
                got = await store.get(1, expected_digest=info.digest)
                cpu[fetch].append(time.process_time() - c0)
                wall[fetch].append(time.perf_counter() - w0)
                assert len(got) == size
    finally:
        await trainer.close()
        await rollout.close()
    return {
        fetch: {
            "cpu_ms_mean": 1000 * statistics.fmean(cpu[fetch]),
            "wall_ms_median": 1000 * statistics.median(wall[fetch]),
        }
        for fetch in cpu
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-kb", type=float, default=47, help="payload size (KB; the quickstart's is 47)")
    parser.add_argument("--gets", type=int, default=300, help="gets per reader")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings and up
    size = int(args.size_kb * 1024)
    with tempfile.TemporaryDirectory() as tmp:
        bundle = write_bundle(Path(tmp) / "auth", RUN)
        with EmbeddedNats(Path(tmp) / "bus", extra_config=server_config(bundle)) as server:
            result = asyncio.run(measure(server.url, bundle, size, args.gets))
    raw, client = result["raw"], result["client"]
    out = {
        "command": "python benchmarks/small_fetch.py " + f"--size-kb {args.size_kb:g} --gets {args.gets}",
        "size_bytes": size,
        "auto_uses": "client" if size < RAW_FETCH_MIN_BYTES else "raw",
        "loadavg_1m": os.getloadavg()[0],
        **result,
        "raw_over_client_cpu": raw["cpu_ms_mean"] / client["cpu_ms_mean"],
        "raw_over_client_wall": raw["wall_ms_median"] / client["wall_ms_median"],
    }
    print(f"{'reader':<8} {'CPU ms/get':>11} {'wall ms/get (median)':>21}")
    for fetch in ("raw", "client"):
        print(f"{fetch:<8} {result[fetch]['cpu_ms_mean']:>11.2f} {result[fetch]['wall_ms_median']:>21.2f}")
    print(f"raw/client: CPU {out['raw_over_client_cpu']:.2f}x, wall {out['raw_over_client_wall']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
