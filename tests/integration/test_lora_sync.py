"""LoRA RL over a real nats-server: adapter-only sync, applied on the frozen base, byte counts asserted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from miles.backends.base import TrainSample
from miles.backends.fsdp import FsdpBackend
from miles.bus.client import Bus
from miles.bus.server import EmbeddedNats
from miles.config import BusConfig, FsdpBackendConfig, LoraConfig, TinyModelConfig, TrainerConfig
from miles.engines.torch_engine import TorchEngine
from miles.models import tiny
from miles.sync.engine_weights import EngineWeights
from miles.sync.follower import WeightFollower
from miles.sync.lora import lora_scale
from miles.sync.payload import serialize_state
from miles.sync.publisher import WeightPublisher
from miles.sync.transport.dataplane import WeightStore
from miles.training.step import RLStep, plan_batch

from .harness import check_held_weights, run_to_completion, small_run_config
from .sync_helpers import adopted, running, until

MODEL = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, seed=3)
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])


@pytest.fixture
async def bus(nats_server: str) -> AsyncIterator[Bus]:
    handle = await Bus.open(BusConfig(), nats_server, "lsync", "test")
    yield handle
    await handle.close()


def _model() -> torch.nn.Module:
    return tiny.build_tiny_model(MODEL, tiny.build_char_tokenizer())


def _batch(step: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(step)
    out = []
    for i in range(6):
        ids = torch.randint(4, 40, (7,), generator=g).tolist()
        out.append(TrainSample(ids[:4], ids[4:], [1] * 3, [-2.0] * 3, advantage=(-1.0) ** i, weight_version=step))
    return out


def _export(trainer: FsdpBackend, *, adapter_only: bool = False) -> dict[str, torch.Tensor]:
    """The trainer's streamed export as a state dict of copies (float32, CPU): later steps must not change it."""
    return {name: t.clone() for name, t in trainer.export_params(adapter_only=adapter_only)}


async def test_lora_mode_moves_only_adapter_bytes_and_workers_run_base_plus_adapter(bus: Bus) -> None:
    cfg = TrainerConfig(lr=1e-2, lora=LORA, backend=FsdpBackendConfig(threads=1))
    trainer = FsdpBackend(_model(), cfg)
    step = RLStep(trainer, cfg, pad_id=tiny.build_char_tokenizer().pad_token_id)
    base = {k: v.clone() for k, v in _model().state_dict().items()}
    full_bytes = len(serialize_state({k: v.to(torch.bfloat16) for k, v in base.items()}, 0))

    store = await WeightStore.create(bus.js, "lsync", keep_versions=3)
    publisher = WeightPublisher(bus, store, "float32", mode="lora")
    tok = tiny.build_char_tokenizer()
    engine = TorchEngine(_model(), tok.pad_token_id)
    decoder = EngineWeights(engine.model.state_dict, lora_scale=lora_scale(LORA))
    follower = WeightFollower(bus, store, engine, decoder=decoder)

    adapter = _export(trainer, adapter_only=True)
    expected_size = len(serialize_state(adapter, 0))
    # Only the adapter travels: q and v of two layers, rank 4, in float32, plus the safetensors header.
    assert sum(t.numel() for t in adapter.values()) == 2 * 2 * (4 * 64 + 64 * 4)
    assert expected_size < 0.02 * 2 * full_bytes  # < 2% of the base even in float32 against a bf16 base

    sizes = []
    async with engine, running(follower):
        for version in range(4):
            if version:
                step.run(plan_batch(_batch(version), cfg.algo.minibatches, 1)[0])
                adapter = _export(trainer, adapter_only=True)
            ann = (await publisher.publish(adapter, version)).announcement
            assert ann.mode == "lora" and ann.size == expected_size
            sizes.append(ann.size)
            await until(lambda v=version: follower.held_version >= v)
            await adopted(engine, version)  # the started engine applies what the follower staged

            merged = _export(trainer)  # the trainer's policy: base + adapter
            held = engine.model.state_dict()
            for name, tensor in held.items():
                if name.endswith(("q_proj.weight", "v_proj.weight")):
                    torch.testing.assert_close(tensor, merged[name], rtol=0, atol=1e-6, msg=name)
                    assert version == 0 or not torch.equal(tensor, base[name]), name
                else:
                    assert torch.equal(tensor, base[name]), name  # the frozen base is never touched
    # Nothing but adapters was downloaded (version 0, B = 0, is the base the engine already runs: not fetched).
    assert follower.fetches == 3 and follower.fetched_bytes == sum(sizes[1:])


async def test_an_adapter_that_does_not_fit_the_base_fails_the_worker_loudly(bus: Bus) -> None:
    store = await WeightStore.create(bus.js, "lsync", keep_versions=3)
    publisher = WeightPublisher(bus, store, "float32", mode="lora")
    engine = TorchEngine(_model(), 0)
    follower = WeightFollower(bus, store, engine, decoder=EngineWeights(engine.model.state_dict, lora_scale=2.0))
    wrong = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32),  # base is 64 wide
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4),
    }
    async with engine, running(follower) as stopping:
        await publisher.publish(wrong, 1)
        with pytest.raises(ValueError, match="q_proj"):
            await asyncio.wait_for(follower.wait_for(1, stopping), 20)
    assert engine.version == 0


@pytest.mark.slow
def test_lora_run_end_to_end(tmp_path: Path, server: EmbeddedNats, model_cache: Path) -> None:
    """controller + 2 rollout workers + trainer as processes in sync.mode lora: the trainer publishes only
    adapters, every worker fetches only adapter bytes, and the run completes with full accounting."""
    cfg = small_run_config(
        model_cache,
        "lora",
        **{"sync.mode": "lora", "trainer.lora.rank": 2, "trainer.lora.target_modules": ["q_proj", "v_proj"]},
    )
    cluster = run_to_completion(cfg, tmp_path / "run", server.url)
    summary = cluster.summary()
    assert summary["steps"] == cfg.trainer.steps and summary["dead_lettered"] == 0

    published = [json.loads(line) for line in cluster.log("trainer-0").splitlines() if "weights_published" in line]
    assert [p["mode"] for p in published] == ["lora"] * (cfg.trainer.steps + 1)
    # hidden 32, one layer: q and v adapters of rank 2 in bf16 = 2 * (2*32 + 32*2) * 2 bytes, plus the header
    adapter_bytes = {p["bytes"] for p in published}
    assert len(adapter_bytes) == 1 and 512 < (size := adapter_bytes.pop()) < 1536
    assert set(summary["sync_bytes"]) == {"lora"}  # the controller saw nothing but adapters go out
    assert summary["sync_bytes"]["lora"]["max"] == size and summary["sync_bytes"]["lora"]["versions"] >= 6
    check_held_weights(cluster)
    for name in ("rollout-0", "rollout-1"):
        assert '"weights_applied"' in cluster.log(name)
