"""Weight transports against real servers: streamed data-plane puts, the bus, a shared directory, a gloo
weight-update group (including a member that dies) and SGLang's distributed update (a fake server)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from nats.aio.client import Client

from miles.bus.errors import BusError, ChecksumMismatch, PayloadMissing
from miles.ports import free_port
from miles.sync.checksum import digest
from miles.sync.payload import serialize_state
from miles.sync.precision import state_digest, to_rollout_state
from miles.sync.stream_export import PayloadLayout, StateHasher, TensorSpec
from miles.sync.transport import FallbackTransport, TransportBroken, verified_state
from miles.sync.transport.broadcast import BroadcastReceiver, BroadcastTransport, WeightUpdateGroup
from miles.sync.transport.bus import BusTransport
from miles.sync.transport.dataplane import WeightStore
from miles.sync.transport.fs import FsTransport
from miles.sync.transport.sglang import SglangDistributedSync, SglangUpdateError

CHUNK = 4096


def state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(40, 32, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(32, 64, generator=g),
        "model.layers.0.input_layernorm.weight": torch.rand(32, generator=g),
        "lm_head.weight": torch.randn(40, 32, generator=g),
    }


def plan(s: dict[str, torch.Tensor], precision: str, version: int) -> PayloadLayout:
    return PayloadLayout.plan([TensorSpec.of(n, t) for n, t in s.items()], precision, version)


def params_of(s: dict[str, torch.Tensor]) -> Any:
    return lambda: iter(sorted(s.items()))


async def _store(nc: Client, keep: int = 3) -> WeightStore:
    return await WeightStore.create(nc.jetstream(), "t", chunk_bytes=CHUNK, keep_versions=keep)


# --------------------------------------------------------------------------- data plane: streaming put


@pytest.mark.parametrize("pieces", [[0], [1], [CHUNK], [CHUNK + 1], [5, 4091, 1, CHUNK * 3, 17, 0, 2 * CHUNK - 3]])
async def test_streamed_put_stores_what_put_stores(nc: Client, pieces: list[int]) -> None:
    store = await _store(nc)
    payload = os.urandom(sum(pieces))
    whole = await store.put(1, payload)
    async with store.writer(2, len(payload)) as w:
        offset = 0
        for size in pieces:
            await w.write(memoryview(payload)[offset : offset + size])
            offset += size
    assert w.info is not None
    assert (w.info.size, w.info.chunks, w.info.digest) == (whole.size, whole.chunks, whole.digest)
    assert await store.get(2, expected_digest=whole.digest) == payload
    assert await store.info(2) == w.info


async def test_streamed_put_commits_only_on_success(nc: Client) -> None:
    store = await _store(nc)
    with pytest.raises(RuntimeError, match="export failed"):
        async with store.writer(3) as w:
            await w.write(os.urandom(3 * CHUNK))
            raise RuntimeError("export failed")
    with pytest.raises(PayloadMissing):
        await store.get(3)
    with pytest.raises(BusError, match="expected 10"):
        async with store.writer(4, 10) as w:
            await w.write(b"short")
    with pytest.raises(PayloadMissing):
        await store.get(4)
    assert await store.versions() == []
    await store.put(3, b"again")  # the interrupted version is replaced cleanly
    assert await store.get(3) == b"again"


# --------------------------------------------------------------------------- bus transport


@pytest.mark.parametrize("precision", ["bfloat16", "fp8_e4m3", "fp4_e2m1"])
async def test_bus_transport_round_trip(nc: Client, precision: str) -> None:
    transport = BusTransport(await _store(nc))
    s = state()
    published = await transport.publish(plan(s, precision, 7), params_of(s))
    expected = to_rollout_state(s, precision)
    assert published.transport == "bus" and published.state_digest == state_digest(expected)
    payload = await transport.fetch(7, published.digest)
    got = verified_state(payload, published.state_digest)
    assert sorted(got) == sorted(expected)
    if precision == "bfloat16":  # single dtype: the very bytes (and digest) of today's whole-state publish
        assert published.digest == digest(serialize_state(expected, 7))
    with pytest.raises(ChecksumMismatch):
        verified_state(payload, "0" * 32)


# --------------------------------------------------------------------------- shared filesystem


async def test_fs_transport_publishes_atomically_and_verifies(tmp_path: Path) -> None:
    companion = tmp_path / "model"
    companion.mkdir()
    (companion / "config.json").write_text("{}")
    (companion / "model.safetensors").write_bytes(b"old weights")
    transport = FsTransport(tmp_path / "weights", keep_versions=2, companion_dir=str(companion))
    s = state()
    published = [await transport.publish(plan(s, "bfloat16", v), params_of(s)) for v in (1, 2, 3)]
    assert transport.versions() == [2, 3]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v2", "v3"]  # no temporary dirs
    last = published[-1]
    assert last.location == str(tmp_path / "weights" / "v3")
    assert (Path(last.location) / "config.json").exists()
    assert json.loads((Path(last.location) / "manifest.json").read_text())["state_digest"] == last.state_digest
    payload = await transport.fetch(3, last.digest, location=Path(last.location).name)  # as announced
    assert state_digest(verified_state(payload, last.state_digest)) == state_digest(to_rollout_state(s, "bfloat16"))

    with pytest.raises(PayloadMissing):
        await transport.fetch(1, published[0].digest)
    raw = Path(last.location) / "model.safetensors"
    data = bytearray(raw.read_bytes())
    data[-1] ^= 1
    raw.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch):
        await transport.fetch(3, last.digest)


async def test_fs_transport_failed_export_leaves_nothing(tmp_path: Path) -> None:
    transport = FsTransport(tmp_path)
    s = state()

    def broken() -> Iterator[tuple[str, torch.Tensor]]:
        yield from sorted(s.items())[:2]
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        await transport.publish(plan(s, "bfloat16", 1), broken)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- broadcast weight-update group


async def _form_group(world_size: int, port: int, timeout_s: float = 30.0) -> list[WeightUpdateGroup]:
    joins = [
        asyncio.to_thread(WeightUpdateGroup.join, "127.0.0.1", port, r, world_size, name="wug", timeout_s=timeout_s)
        for r in range(world_size)
    ]
    return list(await asyncio.gather(*joins))


async def test_broadcast_transport_delivers_verified_payloads() -> None:
    sender_group, *receiver_groups = await _form_group(3, free_port())
    sender = BroadcastTransport(sender_group, bucket_bytes=1000)
    receivers = [await BroadcastReceiver(g).start() for g in receiver_groups]
    try:
        for version, precision in ((1, "bfloat16"), (2, "fp4_e2m1")):
            s = state(version)
            published = await sender.publish(plan(s, precision, version), params_of(s))
            assert published.transport == "broadcast" and published.location == "wug"
            assert published.chunks == -(-published.size // 1000)
            for receiver in receivers:
                payload = await receiver.fetch(version, published.digest, timeout_s=10)
                got = verified_state(payload, published.state_digest)
                assert state_digest(got) == state_digest(to_rollout_state(s, precision))

        # An export error mid-round: the round is aborted, the group stays usable.
        s = state(3)

        def failing() -> Iterator[tuple[str, torch.Tensor]]:
            yield from sorted(s.items())[:3]
            raise RuntimeError("gather failed")

        with pytest.raises(RuntimeError, match="gather failed"):
            await sender.publish(plan(s, "bfloat16", 3), failing)
        assert sender.broken is None
        with pytest.raises(PayloadMissing):
            await receivers[0].fetch(3, "x", timeout_s=0.5)
        published = await sender.publish(plan(s, "bfloat16", 4), params_of(s))
        assert (await receivers[1].fetch(4, published.digest, timeout_s=10)).nbytes == published.size
        with pytest.raises(ChecksumMismatch):
            await receivers[0].fetch(4, "0" * 32)
        with pytest.raises(PayloadMissing):  # superseded by version 4
            await receivers[0].fetch(3, "x", timeout_s=10)
    finally:
        for receiver in receivers:
            await receiver.stop()


def _dying_receiver(port: int, world_size: int, rank: int, inbox: Any, out: Any) -> None:
    """Receives round 1, reports it, then dies without leaving the group."""

    async def main() -> None:
        group = WeightUpdateGroup.join("127.0.0.1", port, rank, world_size, name="wug", timeout_s=10)
        receiver = await BroadcastReceiver(group).start()
        ann = await asyncio.to_thread(inbox.get, True, 60)
        payload = await receiver.fetch(ann["version"], ann["digest"], timeout_s=30)
        out.put(digest(payload))
        out.close()
        out.join_thread()  # flushed before the abrupt exit below
        os._exit(0)

    asyncio.run(main())


async def test_member_death_breaks_the_group_and_falls_back_to_the_bus(nc: Client) -> None:
    port = free_port()
    ctx = mp.get_context("spawn")
    inbox, queue = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_dying_receiver, args=(port, 3, 2, inbox, queue))
    child.start()
    try:
        sender_group, receiver_group = await asyncio.gather(
            asyncio.to_thread(WeightUpdateGroup.join, "127.0.0.1", port, 0, 3, name="wug", timeout_s=5),
            asyncio.to_thread(WeightUpdateGroup.join, "127.0.0.1", port, 1, 3, name="wug", timeout_s=5),
        )
        bus = BusTransport(await _store(nc))
        transport = FallbackTransport(BroadcastTransport(sender_group, bucket_bytes=1000), bus)
        survivor = await BroadcastReceiver(receiver_group).start()
        s = state()
        first = await transport.publish(plan(s, "bfloat16", 1), params_of(s))
        assert first.transport == "broadcast"
        inbox.put({"version": 1, "digest": first.digest})
        assert await asyncio.to_thread(queue.get, True, 60) == first.digest
        await asyncio.to_thread(child.join, 30)

        second = await transport.publish(plan(s, "bfloat16", 2), params_of(s))
        assert second.transport == "bus" and transport.fallbacks == 1 and transport.primary is None
        assert (await bus.fetch(2, second.digest)).nbytes == second.size  # what the survivor reads instead
        third = await transport.publish(plan(state(3), "bfloat16", 3), params_of(state(3)))
        assert third.transport == "bus"
        with pytest.raises((TransportBroken, PayloadMissing)):
            await survivor.fetch(2, second.digest, timeout_s=20)
        with pytest.raises(TransportBroken):
            await survivor.stop()
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)


# --------------------------------------------------------------------------- SGLang (fake server)


def _fake_sglang(port_out: Any) -> None:
    """A contract stand-in for SGLang's weight-update endpoints: it joins the group with torch's own group
    helper, as SGLang does, and receives every tensor by ``dist.broadcast(src=0)``."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    record: dict[str, Any] = {"init": None, "updates": [], "weight_version": None}
    groups: dict[str, Any] = {}
    received: dict[str, torch.Tensor] = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            hasher = StateHasher()
            for name in sorted(received):
                hasher.update(name, received[name])
            self._reply(record | {"state_digest": hasher.hexdigest(), "names": sorted(received)})

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/init_weights_update_group":
                record["init"] = body
                init = f"tcp://{body['master_address']}:{body['master_port']}"
                store, rank, world = next(
                    rendezvous(init, body["rank_offset"], body["world_size"], timeout=timedelta(seconds=30))
                )
                store = PrefixStore(body["group_name"], store)
                pg, _ = _new_process_group_helper(
                    world, rank, [], Backend(body["backend"]), store, group_name=body["group_name"],
                    timeout=timedelta(seconds=30),
                )  # fmt: skip
                _world.pg_group_ranks[pg] = {i: i for i in range(world)}
                groups[body["group_name"]] = pg
                self._reply({"success": True, "message": "joined"})
            elif self.path == "/update_weights_from_distributed":
                record["updates"].append(body)
                for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
                    tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                    dist.broadcast(tensor, src=0, group=groups[body["group_name"]])
                    received[name] = tensor
                if "weight_version" in body:
                    record["weight_version"] = body["weight_version"]
                self._reply({"success": True, "message": "updated"})
            else:
                self._reply({"success": False, "message": f"unknown route {self.path}"})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port_out.put(server.server_address[1])
    server.serve_forever()


@pytest.fixture
def fake_sglang() -> Iterator[str]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_fake_sglang, args=(queue,), daemon=True)
    proc.start()
    try:
        yield f"http://127.0.0.1:{queue.get(timeout=60)}"
    finally:
        proc.kill()
        proc.join(10)


async def test_sglang_distributed_update_contract(fake_sglang: str) -> None:
    import urllib.request

    sync = SglangDistributedSync(
        [fake_sglang], master_addr="127.0.0.1", master_port=free_port(), backend="gloo", bucket_bytes=9000
    )
    await asyncio.to_thread(sync.connect)
    s = state()
    layout = plan(s, "bfloat16", 5)
    published = await sync.publish(layout, params_of(s))
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        await sync.publish(plan(s, "fp8_e4m3", 6), params_of(s))
    sync.close()

    seen = json.loads(await asyncio.to_thread(lambda: urllib.request.urlopen(fake_sglang).read()))
    assert seen["init"] == {
        "master_address": "127.0.0.1",
        "master_port": sync.master_port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "miles_weights",
        "backend": "gloo",
    }
    updates = seen["updates"]
    assert len(updates) == published.chunks > 1
    assert [n for u in updates for n in u["names"]] == layout.names
    assert all(set(u["dtypes"]) == {"bfloat16"} for u in updates)
    assert [u["flush_cache"] for u in updates] == [False] * (len(updates) - 1) + [True]
    assert ["weight_version" in u for u in updates] == [False] * (len(updates) - 1) + [True]
    assert seen["weight_version"] == "5"
    expected = state_digest(to_rollout_state(s, "bfloat16"))
    assert published.state_digest == seen["state_digest"] == expected  # the server got exactly these bits
    assert published.transport == "sglang" and published.digest == ""


async def test_sglang_refusal_surfaces() -> None:
    received = threading.Event()

    class Refuse(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            received.set()
            data = json.dumps({"success": False, "message": "group exists"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        sync = SglangDistributedSync(
            [f"http://127.0.0.1:{server.server_address[1]}"],
            master_addr="127.0.0.1",
            master_port=free_port(),
            backend="gloo",
            timeout_s=3,
        )
        with pytest.raises((SglangUpdateError, RuntimeError)):
            await asyncio.to_thread(sync.connect)
        assert received.is_set()
        sync.close()
    finally:
        server.shutdown()
        thread.join()
