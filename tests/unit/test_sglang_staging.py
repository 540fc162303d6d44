"""SglangStagingEngine against the fake SGLang HTTP server (a contract stand-in: SGLang needs a GPU):
non-blocking staging, newest-wins background loads, pinning, visible load failures, what lands on disk and
what the server is asked; plus a WeightFollower over a real nats-server."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
from safetensors.torch import load_file

from miles.bus.client import Bus
from miles.config import BusConfig, LoraConfig, SglangEngineConfig
from miles.engines.adapter_files import load_peft_adapter
from miles.engines.base import SamplingParams, SparseValues
from miles.engines.sglang_engine import SglangEngine, SglangError
from miles.engines.sglang_staging import SglangStagingEngine
from miles.sync.follower import WeightFollower
from miles.sync.publisher import WeightPublisher
from miles.sync.transport.dataplane import WeightStore

from ..integration.sync_helpers import running, until
from .test_sglang_engine_contract import FakeSglangServer

LORA = LoraConfig(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"])
HIDDEN = 8


class GatedServer(FakeSglangServer):
    """The fake server, whose ``/load_lora_adapter`` can be held (``load_gate``) to catch a load in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.load_gate: threading.Event | None = None
        self.load_started = threading.Event()

    def load_lora_adapter(self, body: dict[str, Any]) -> tuple[int, Any]:
        self.load_started.set()
        if self.load_gate is not None:
            self.load_gate.wait(10)
        return super().load_lora_adapter(body)

    def loaded_names(self) -> list[str]:
        return [b["lora_name"] for p, b in self.lora_calls() if p == "/load_lora_adapter"]


@pytest.fixture
def fake() -> Iterator[GatedServer]:
    server = GatedServer()
    server.thread.start()
    yield server
    if server.load_gate is not None:
        server.load_gate.set()
    server.httpd.shutdown()
    server.httpd.server_close()


def sglang(fake: FakeSglangServer) -> SglangEngine:
    return SglangEngine(SglangEngineConfig(url=fake.url, timeout_s=5, keep_adapters=2))


@pytest.fixture
async def staging(fake: GatedServer, tmp_path: Path) -> AsyncIterator[SglangStagingEngine]:
    """A started LoRA-mode staging engine writing under ``tmp_path/adapters``; closed at the end."""
    async with SglangStagingEngine(sglang(fake), tmp_path / "adapters", lora=LORA) as engine:
        yield engine


def adapter(version: int) -> dict[str, torch.Tensor]:
    """A peft-named LoRA adapter for two layers of q/v projections, distinct per version."""
    g = torch.Generator().manual_seed(version)
    out = {}
    for layer in range(2):
        for proj in LORA.target_modules:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(LORA.rank, HIDDEN, generator=g)
            out[f"{prefix}.lora_B.weight"] = torch.randn(HIDDEN, LORA.rank, generator=g)
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


# ---------------------------------------------------------------------------------------------- LoRA


async def test_lora_stage_returns_at_once_and_the_newest_is_loaded_in_order(
    fake: GatedServer, staging: SglangStagingEngine, tmp_path: Path
) -> None:
    engine = staging
    assert engine.version == 0 and engine.pending_version is None and engine.switches == 0
    fake.load_gate = threading.Event()
    staged = {v: adapter(v) for v in (1, 2, 3)}

    assert engine.stage_weights(staged[1], 1, complete=False)
    assert await asyncio.to_thread(fake.load_started.wait, 5)  # v1 is in the server's hands, which hold it there
    start = time.perf_counter()
    assert engine.stage_weights(staged[2], 2, complete=False)
    assert engine.stage_weights(staged[3], 3, complete=False)  # replaces 2, not yet taken
    elapsed = time.perf_counter() - start
    assert engine.version == 0 and engine.pending_version == 3  # both returned while the load is stuck
    assert elapsed < 2.0
    assert not engine.stage_weights(staged[2], 2, complete=False)  # not newer than what is staged
    assert not engine.stage_weights(staged[3], 3, complete=False)

    fake.load_gate.set()
    assert await asyncio.to_thread(engine.wait_idle, 10)
    assert engine.version == 3 and engine.pending_version is None and engine.last_error is None
    assert fake.loaded_names() == ["miles-v1", "miles-v3"]  # 2 skipped, nothing out of order
    assert engine.switches == 2 and engine.last_pause_s > 0
    assert not engine.stage_weights(staged[1], 1, complete=False)

    tensors, config = load_peft_adapter(tmp_path / "adapters" / "v3")
    assert_same(tensors, staged[3])
    assert config["r"] == LORA.rank and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert fake.adapters["miles-v3"] == str((tmp_path / "adapters" / "v3").resolve())

    gen = await engine.generate([1, 2], SamplingParams(max_new_tokens=2))
    assert fake.requests[-1][2]["lora_path"] == "miles-v3" and gen.weight_version == 3


async def test_a_failed_load_is_reported_keeps_the_version_and_is_retried(
    fake: GatedServer, staging: SglangStagingEngine
) -> None:
    engine = staging
    assert engine.stage_weights(adapter(1), 1) and await asyncio.to_thread(engine.wait_idle, 10)
    assert engine.version == 1 and engine.switches == 1
    assert engine.heartbeat_stats() == {
        "weight_load_failures": 0.0,
        "weight_load_failing": 0.0,
        "last_write_ms": pytest.approx(engine.last_write_s * 1e3),
    }

    fake.fail_loads["miles-v2"] = "LoRA rank 64 exceeds --max-lora-rank 16"
    with structlog.testing.capture_logs() as logs:
        assert engine.stage_weights(adapter(2), 2)
        assert await asyncio.to_thread(engine.wait_idle, 10)
    assert engine.version == 1 and engine.pending_version is None and engine.switches == 1
    assert isinstance(engine.last_error, SglangError) and "max-lora-rank 16" in str(engine.last_error)
    assert engine.failures == 1 and engine.error is None  # a failed load is not a dead engine
    stats = engine.heartbeat_stats()
    assert stats["weight_load_failures"] == 1.0 and stats["weight_load_failing"] == 1.0
    failed = [e for e in logs if e["event"] == "sglang_weights_load_failed"]
    assert len(failed) == 1 and failed[0]["version"] == 2 and failed[0]["log_level"] == "error"
    gen = await engine.generate([1], SamplingParams(max_new_tokens=1))
    assert fake.requests[-1][2]["lora_path"] == "miles-v1" and gen.weight_version == 1

    del fake.fail_loads["miles-v2"]
    assert engine.stage_weights(adapter(2), 2)  # the same version again: retried
    assert await asyncio.to_thread(engine.wait_idle, 10)
    assert engine.version == 2 and engine.last_error is None and engine.switches == 2
    assert engine.heartbeat_stats()["weight_load_failing"] == 0.0 and engine.failures == 1
    assert fake.loaded_names() == ["miles-v1", "miles-v2", "miles-v2"]


async def test_pinned_holds_staged_loads_back(fake: GatedServer, staging: SglangStagingEngine) -> None:
    engine = staging
    fake.load_gate = threading.Event()
    assert engine.stage_weights(adapter(1), 1)
    assert await asyncio.to_thread(fake.load_started.wait, 5)

    async def release_soon() -> None:
        await asyncio.sleep(0.05)
        fake.load_gate.set()

    releasing = asyncio.create_task(release_soon())
    async with engine.pinned() as version:  # waits for the load under way, then holds the next ones
        assert version == 1 and engine.version == 1
        assert engine.stage_weights(adapter(2), 2)
        await asyncio.sleep(0.1)
        assert engine.version == 1 and engine.pending_version == 2 and fake.loaded_names() == ["miles-v1"]
        gen = await engine.generate([1], SamplingParams(max_new_tokens=1))
        assert gen.weight_version == 1
    await releasing
    assert await asyncio.to_thread(engine.wait_idle, 10)
    assert engine.version == 2 and fake.loaded_names() == ["miles-v1", "miles-v2"]


async def test_only_the_newest_version_directories_are_kept(
    fake: GatedServer, staging: SglangStagingEngine, tmp_path: Path
) -> None:
    for v in range(1, 6):
        assert staging.stage_weights(adapter(v), v) and await asyncio.to_thread(staging.wait_idle, 10)
    assert staging.version == 5
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["v3", "v4", "v5"]
    assert sorted(fake.adapters) == ["miles-v4", "miles-v5"]  # keep_adapters=2 in the server


def test_lora_mode_refuses_what_is_not_an_adapter(fake: GatedServer, tmp_path: Path) -> None:
    engine = SglangStagingEngine(sglang(fake), tmp_path / "adapters", lora=LORA)
    with pytest.raises(ValueError, match="peft LoRA keys"):
        engine.stage_weights({"model.layers.0.self_attn.q_proj.weight": torch.zeros(HIDDEN, HIDDEN)}, 1)
    key = next(iter(adapter(1)))
    with pytest.raises(ValueError, match="sparse"):
        engine.stage_weights({key: SparseValues(torch.tensor([0]), torch.tensor([1.0]))}, 1, complete=False)
    assert engine.pending_version is None and engine.wait_idle(0) and fake.lora_calls() == []


# ---------------------------------------------------------------------------------------------- full


async def test_full_mode_writes_a_checkpoint_and_reloads_it(fake: GatedServer, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    (model_dir / "tokenizer.json").write_text("{}")
    (model_dir / "pytorch_model.bin").write_bytes(b"old weights")
    embed = torch.randn(16, HIDDEN, dtype=torch.bfloat16)
    state = {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": embed,  # tied: the same tensor twice
        "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
    }
    async with SglangStagingEngine(sglang(fake), tmp_path / "weights", model_dir=model_dir) as engine:
        assert engine.stage_weights(state, 5) and await asyncio.to_thread(engine.wait_idle, 10)
        path = (tmp_path / "weights" / "v5").resolve()
        assert engine.version == 5 and engine.last_error is None and engine.switches == 1
        body = {"model_path": str(path), "weight_version": "5"}
        assert fake.requests[-1] == ("POST", "/update_weights_from_disk", body)
        assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
        assert_same(load_file(path / "model.safetensors"), state)
        gen = await engine.generate([1], SamplingParams(max_new_tokens=1))
        assert gen.weight_version == 5 and "lora_path" not in fake.requests[-1][2]

        fake.update_ok = False
        assert engine.stage_weights(state, 6) and await asyncio.to_thread(engine.wait_idle, 10)
        assert engine.version == 5 and "shape mismatch" in str(engine.last_error) and engine.switches == 1


def test_full_mode_refuses_sparse_and_partial_updates(fake: GatedServer, tmp_path: Path) -> None:
    engine = SglangStagingEngine(sglang(fake), tmp_path / "weights")
    sparse = {"model.norm.weight": SparseValues(torch.tensor([0, 3]), torch.tensor([1.0, 2.0]))}
    # The follower's delta fast path (a base version given) is declined, not refused: the follower then stages
    # the whole reconstructed state. Raising there ended the follower in delta mode.
    assert not engine.stage_weights(sparse, 1, base_version=0, complete=False)
    with pytest.raises(ValueError, match="sparse"):
        engine.stage_weights(sparse, 1)
    with pytest.raises(ValueError, match="complete=False"):
        engine.stage_weights({"model.norm.weight": torch.ones(HIDDEN)}, 1, complete=False)
    assert engine.pending_version is None and engine.version == 0
    assert not (tmp_path / "weights").exists() and fake.requests == []


# ---------------------------------------------------------------------------------------------- follower


class PassAdapterThrough:
    """The rollout worker's decoder in SGLang LoRA mode: the adapter itself, a partial update."""

    def decode(self, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
        return dict(state), False


async def test_weight_follower_drives_sglang_to_the_newest_adapter(
    fake: GatedServer, tmp_path: Path, nats_server: str
) -> None:
    bus = await Bus.open(BusConfig(), nats_server, "ssync", "test")
    try:
        store = await WeightStore.create(bus.js, "ssync", keep_versions=3)
        publisher = WeightPublisher(bus, store, "float32", mode="lora")
        async with SglangStagingEngine(sglang(fake), tmp_path / "adapters", lora=LORA) as engine:
            follower = WeightFollower(bus, store, engine, decoder=PassAdapterThrough())  # type: ignore[arg-type]
            async with running(follower):
                for v in (1, 2, 3):
                    await publisher.publish(adapter(v), v)
                await until(lambda: engine.version == 3, timeout_s=15)
            assert follower.held_version == 3 and engine.last_error is None
            names = fake.loaded_names()
            assert names[-1] == "miles-v3" and names == sorted(set(names), key=lambda n: int(n.rsplit("v", 1)[1]))
            assert "miles-v3" in fake.adapters
            tensors, _ = load_peft_adapter(tmp_path / "adapters" / "v3")
            assert_same(tensors, adapter(3))
            await engine.generate([1], SamplingParams(max_new_tokens=1))
            assert fake.requests[-1][2]["lora_path"] == "miles-v3"
    finally:
        await bus.close()
