"""Weight data plane throughput: WeightStore vs nats-py's object store vs a raw loopback socket.

    python benchmarks/dataplane.py --size-mb 64 --repeats 3

Starts an embedded nats-server (JetStream on a temporary directory) and, in one run, measures on the
same random payload:

* ``WeightStore`` put and get (the whole API call: digest, chunked pipelined publish and manifest;
  manifest read, fetch and digest verification) for each chunk size in ``--chunk-mb``, stream storage
  in ``--storage`` and reader in ``--fetch`` (``raw``: our zero-copy reader into a fresh buffer,
  ``raw-into``: the same into a reused buffer, ``client``: nats-py direct gets);
* nats-py's object store put and get (the baseline that moved 64 MB in about 10 s);
* a raw loopback TCP transfer: a sender process ``sendall``\\ s the bytes, this process ``recv_into``\\ s
  them into a fresh buffer, and into a reused one (the ceiling for any store-and-forward design here;
  each WeightStore reader is compared with the raw transfer of the same buffer policy; measured
  before and after the rest, as the load from other jobs drifts).

Prints a table (median and best MB/s over the repeats, client CPU seconds per GB moved) and the ratios
ours/raw and ours/object store; ``--json PATH`` writes everything, with the host's load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import mmap
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import struct
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from miles.bus.connect import connect
from miles.bus.server import EmbeddedNats
from miles.sync.checksum import digest
from miles.sync.transport.dataplane import CHUNK_HEADROOM, WeightStore

MiB = 1024 * 1024


@dataclass
class Row:
    method: str
    chunk_mb: float | None = None
    storage: str | None = None
    fetch: str | None = None
    put_mb_s: list[float] = field(default_factory=list)
    get_mb_s: list[float] = field(default_factory=list)
    get_cpu_s_per_gb: list[float] = field(default_factory=list)

    @staticmethod
    def _median(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    @property
    def put(self) -> float | None:
        return self._median(self.put_mb_s)

    @property
    def get(self) -> float | None:
        return self._median(self.get_mb_s)


def _server_cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


# --------------------------------------------------------------------------- raw socket


def _raw_sender(port: int, size: int, transfers: int) -> None:
    payload = os.urandom(size)
    for _ in range(transfers):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(struct.pack("!Q", size))
            sock.sendall(payload)
            sock.recv(1)  # wait for the receiver's ack so transfers do not overlap


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(len(view) - got, 4 * MiB))
        if n == 0:
            raise ConnectionError("sender closed early")
        got += n


def bench_raw_socket(size: int, repeats: int) -> tuple[Row, Row]:
    """Plain-socket transfers into a fresh buffer (as ``WeightStore.get``) and into a reused one (as
    ``get(into=...)``), alternating; the sender is a separate process."""
    fresh = Row(method="raw loopback TCP, fresh buffer", fetch="recv_into")
    reused = Row(method="raw loopback TCP, reused buffer", fetch="recv_into")
    kept = memoryview(bytearray(size))
    ctx = mp.get_context("spawn")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        sender = ctx.Process(target=_raw_sender, args=(listener.getsockname()[1], size, 2 * repeats), daemon=True)
        sender.start()
        for i in range(2 * repeats):
            row = fresh if i % 2 == 0 else reused
            conn, _ = listener.accept()
            with conn:
                _recv_exact(conn, memoryview(bytearray(8)))
                cpu0, t0 = time.process_time(), time.perf_counter()
                dest = memoryview(mmap.mmap(-1, size)) if row is fresh else kept  # same allocator as get()
                _recv_exact(conn, dest)
                dt = time.perf_counter() - t0
                row.get_mb_s.append(size / MiB / dt)
                row.get_cpu_s_per_gb.append((time.process_time() - cpu0) / (size / 1024**3))
                conn.sendall(b"k")
                del dest
        sender.join(timeout=30)
    return fresh, reused


# --------------------------------------------------------------------------- WeightStore


async def bench_weight_store(
    url: str, payload: bytes, chunk_mb: float, storage: str, fetches: list[str], repeats: int
) -> list[Row]:
    """Per version: one put, then one get per reader (``raw-into`` = raw reader into a reused buffer)."""
    nc = await connect(url, name="bench")
    js = nc.jetstream(timeout=60)
    size = len(payload)
    # "--chunk-mb 8" means what WeightStore picks on an 8 MB max_payload server: 8 MB minus the headroom.
    chunk = min(int(chunk_mb * MiB), nc.max_payload) - CHUNK_HEADROOM
    run = f"bench{int(chunk_mb * 1000)}{storage[0]}"
    store = await WeightStore.create(js, run, chunk_bytes=chunk, keep_versions=2, storage=storage)  # type: ignore[arg-type]
    rows = {f: Row(method="WeightStore", chunk_mb=round(chunk / MiB, 3), storage=storage, fetch=f) for f in fetches}
    kept = bytearray(size)
    expected = digest(payload)
    for version in range(repeats):
        t0 = time.perf_counter()
        info = await store.put(version, payload)
        rows[fetches[0]].put_mb_s.append(size / MiB / (time.perf_counter() - t0))
        for fetch in fetches:
            store.fetch = "raw" if fetch == "raw-into" else fetch  # type: ignore[assignment]
            cpu0, t0 = time.process_time(), time.perf_counter()
            got = await store.get(version, expected_digest=info.digest, into=kept if fetch == "raw-into" else None)
            dt = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
            assert len(got) == size and info.digest == expected
            rows[fetch].get_mb_s.append(size / MiB / dt)
            rows[fetch].get_cpu_s_per_gb.append(cpu / (size / 1024**3))
            del got
    await js.delete_stream(store.stream)
    await nc.close()
    return list(rows.values())


# --------------------------------------------------------------------------- object store


async def bench_object_store(url: str, payload: bytes, repeats: int) -> Row:
    row = Row(method="nats-py object store (put / get)")
    nc = await connect(url, name="bench-obj")
    js = nc.jetstream(timeout=120)
    obs = await js.create_object_store("benchweights")
    for i in range(repeats):
        t0 = time.perf_counter()
        await obs.put(f"v{i}", payload)
        row.put_mb_s.append(len(payload) / MiB / (time.perf_counter() - t0))
        cpu0, t0 = time.process_time(), time.perf_counter()
        result = await obs.get(f"v{i}")
        dt = time.perf_counter() - t0
        assert result.data is not None and len(result.data) == len(payload)
        row.get_mb_s.append(len(payload) / MiB / dt)
        row.get_cpu_s_per_gb.append((time.process_time() - cpu0) / (len(payload) / 1024**3))
        await obs.delete(f"v{i}")
    await js.delete_object_store("benchweights")
    await nc.close()
    return row


# --------------------------------------------------------------------------- main


def _fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _baseline(row: Row, raw_fresh: Row, raw_reused: Row) -> Row:
    return raw_reused if row.fetch == "raw-into" else raw_fresh


def _print_table(rows: list[Row], raw_fresh: Row, raw_reused: Row) -> None:
    header = [
        "method",
        "chunk MB",
        "storage",
        "reader",
        "put MB/s median (best)",
        "get MB/s median (best)",
        "get / raw",
        "get client CPU s/GB",
    ]
    lines = [header]
    for r in rows:
        base = _baseline(r, raw_fresh, raw_reused)
        lines.append(
            [
                r.method,
                _fmt(r.chunk_mb, 2) if r.chunk_mb else "-",
                r.storage or "-",
                r.fetch or "-",
                f"{_fmt(r.put)} ({_fmt(max(r.put_mb_s))})" if r.put_mb_s else "-",
                f"{_fmt(r.get)} ({_fmt(max(r.get_mb_s))})" if r.get_mb_s else "-",
                f"{r.get / base.get:.2f}" if r.get and base.get and r.method == "WeightStore" else "-",
                _fmt(statistics.median(r.get_cpu_s_per_gb), 2) if r.get_cpu_s_per_gb else "-",
            ]
        )
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    for j, line in enumerate(lines):
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths)) + " |")
        if j == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    size = int(args.size_mb * MiB)
    chunk_sizes = [float(c) for c in args.chunk_mb.split(",")]
    storages = args.storage.split(",")
    fetches = args.fetch.split(",")
    max_payload = min(64 * MiB, max(8 * MiB, int(max(chunk_sizes) * MiB)))
    load_before = os.getloadavg()
    payload = os.urandom(size)
    raw_fresh, raw_reused = bench_raw_socket(size, args.repeats)
    rows: list[Row] = [raw_fresh, raw_reused]
    base = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="miles-bench-"))
    server_cpu: dict[str, float] = {}
    try:
        async with EmbeddedNats(base, max_payload=max_payload) as server:
            assert server.pid is not None
            for storage in storages:
                for chunk_mb in chunk_sizes:
                    cpu0 = _server_cpu_s(server.pid)
                    rows += await bench_weight_store(server.url, payload, chunk_mb, storage, fetches, args.repeats)
                    server_cpu[f"{storage}/{chunk_mb}MB"] = round(_server_cpu_s(server.pid) - cpu0, 2)
            if args.objectstore_repeats > 0:
                rows.append(await bench_object_store(server.url, payload, args.objectstore_repeats))
    finally:
        if not args.run_dir:
            shutil.rmtree(base, ignore_errors=True)
    # Measure the baseline again at the end: the load from other jobs drifts during a run.
    late_fresh, late_reused = bench_raw_socket(size, args.repeats)
    for early, late in ((raw_fresh, late_fresh), (raw_reused, late_reused)):
        early.get_mb_s += late.get_mb_s
        early.get_cpu_s_per_gb += late.get_cpu_s_per_gb

    ours = [r for r in rows if r.method == "WeightStore"]
    objstore = next((r for r in rows if r.method.startswith("nats-py object store")), None)
    default_chunk = round((8 * MiB - CHUNK_HEADROOM) / MiB, 3)
    default = next(
        (r for r in ours if r.chunk_mb == default_chunk and r.storage == "file" and r.fetch == "raw"), ours[0]
    )
    best = max(ours, key=lambda r: (r.get or 0) / (_baseline(r, raw_fresh, raw_reused).get or 1))

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 2) if a and b else None

    def put_of(r: Row) -> float | None:
        return next((o.put for o in ours if o.put_mb_s and o.chunk_mb == r.chunk_mb and o.storage == r.storage), None)

    ratios: dict[str, float | None] = {}
    for label, r in (("default", default), ("best", best)):
        ratios[f"{label}_get_vs_raw"] = ratio(r.get, _baseline(r, raw_fresh, raw_reused).get)
        if objstore:
            ratios[f"{label}_get_vs_objectstore"] = ratio(r.get, objstore.get)
            ratios[f"{label}_put_vs_objectstore"] = ratio(put_of(r), objstore.put)
    load_after = os.getloadavg()
    print(
        f"\npayload {args.size_mb:g} MB, repeats {args.repeats}, {os.cpu_count()} CPUs, "
        f"load average {load_before[0]:.2f} -> {load_after[0]:.2f}\n"
    )
    _print_table(rows, raw_fresh, raw_reused)
    print()

    def describe(r: Row) -> str:
        return f"chunk {r.chunk_mb} MB, {r.storage} storage, {r.fetch} reader"

    print(f"default = {describe(default)}; best get/raw = {describe(best)}")
    for key, value in ratios.items():
        print(f"  {key}: {_fmt(value, 2)}x")
    print(f"  nats-server CPU seconds per WeightStore configuration: {server_cpu}")
    return {
        "command": " ".join(["python", *sys.argv]),
        "size_mb": args.size_mb,
        "repeats": args.repeats,
        "loop": args.loop,
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_before": load_before,
            "load_after": load_after,
        },
        "rows": [asdict(r) | {"put_median": r.put, "get_median": r.get} for r in rows],
        "default": describe(default),
        "best": describe(best),
        "ratios": ratios,
        "server_cpu_s": server_cpu,
    }


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=64, help="payload size (MB)")
    parser.add_argument("--repeats", type=int, default=3, help="puts and gets per configuration")
    parser.add_argument("--chunk-mb", default="1,8,32", help="comma-separated WeightStore chunk sizes (MB, <= 64)")
    parser.add_argument("--storage", default="file,memory", help="comma-separated stream storage: file, memory")
    parser.add_argument(
        "--fetch", default="raw,raw-into,client", help="comma-separated readers: raw, raw-into (reused buffer), client"
    )
    parser.add_argument("--objectstore-repeats", type=int, default=1, help="object store runs (slow); 0 skips it")
    parser.add_argument(
        "--loop", choices=["uvloop", "asyncio"], default="uvloop", help="event loop (actors use uvloop)"
    )
    parser.add_argument("--run-dir", default=None, help="keep the server's store here (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args()
    if args.loop == "uvloop":
        import uvloop

        result = uvloop.run(run(args))
    else:
        result = asyncio.run(run(args))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
