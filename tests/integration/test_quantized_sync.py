"""FP8 / FP4 rollout over a real nats-server: workers run exactly the trainer's quantized weights."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from miles.bus.client import Bus
from miles.bus.server import EmbeddedNats
from miles.config import BusConfig, TinyModelConfig
from miles.engines.torch_engine import TorchEngine
from miles.models import tiny
from miles.sync.engine_weights import EngineWeights
from miles.sync.follower import WeightFollower
from miles.sync.precision import from_rollout_state, state_digest, to_rollout_state
from miles.sync.publisher import WeightPublisher, delta_keep_versions
from miles.sync.transport.dataplane import WeightStore

from .harness import check_held_weights, run_to_completion, small_run_config
from .sync_helpers import adopted, running, until

MODEL = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, seed=5)


@pytest.fixture
async def bus(nats_server: str) -> AsyncIterator[Bus]:
    handle = await Bus.open(BusConfig(), nats_server, "qsync", "test")
    yield handle
    await handle.close()


def _master_versions(count: int) -> list[dict[str, torch.Tensor]]:
    """fp32 master weights after ``count - 1`` small Adam-like steps (a few codes change per step)."""
    gen = torch.Generator().manual_seed(0)
    state = {k: v.clone() for k, v in tiny.build_tiny_model(MODEL, tiny.build_char_tokenizer()).state_dict().items()}
    out = [state]
    for _ in range(count - 1):
        out.append({k: v - 2e-3 * torch.randn(v.shape, generator=gen) for k, v in out[-1].items()})
    return out


@pytest.mark.parametrize("precision", ["fp8_e4m3", "fp4_e2m1"])
@pytest.mark.parametrize("mode", ["full", "delta"])
async def test_workers_hold_exactly_the_trainers_quantized_weights(bus: Bus, precision: str, mode: str) -> None:
    full = await WeightStore.create(bus.js, "qsync", keep_versions=3)
    delta = None
    if mode == "delta":
        delta = await WeightStore.create(bus.js, "qsync", keep_versions=delta_keep_versions(3, 10), kind="delta")
    publisher = WeightPublisher(bus, full, precision, mode=mode, delta_store=delta)  # type: ignore[arg-type]
    engine = TorchEngine(tiny.build_tiny_model(MODEL, tiny.build_char_tokenizer()), 0, version=-1)
    follower = WeightFollower(
        bus, full, engine, delta_store=delta, decoder=EngineWeights(engine.model.state_dict, precision=precision)
    )
    async with engine, running(follower):
        for version, master in enumerate(_master_versions(4)):
            published = to_rollout_state(master, precision)
            codes = [n for n, t in published.items() if t.dtype not in (torch.bfloat16, torch.float32)]
            codes = [n for n in codes if not n.endswith(".qscale")]
            assert len(codes) == 2 * 7  # every decoder linear layer, nothing else
            ann = (await publisher.publish(published, version)).announcement
            assert ann.state_digest == state_digest(published) and ann.precision == precision
            assert ann.mode == ("full" if version == 0 or mode == "full" else "delta")
            await until(lambda v=version: follower.held_version >= v)
            await adopted(engine, version)  # the started engine applies what the follower staged
            # What the engine computes with is the dequantized codes, bit for bit; and what the worker
            # reports holding is the published state's digest.
            expected = from_rollout_state(published, torch.float32)
            for name, tensor in engine.model.state_dict().items():
                assert torch.equal(tensor, expected[name]), name
            assert follower.staged_versions[version].state_digest == ann.state_digest
            master_q = master["model.layers.0.mlp.up_proj.weight"]
            assert not torch.equal(expected["model.layers.0.mlp.up_proj.weight"], master_q)  # really quantized
    assert follower.delta_fallbacks == 0


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp8_e4m3", "fp4_e2m1"])
def test_quantized_run_end_to_end_is_audited(
    tmp_path: Path, server: EmbeddedNats, model_cache: Path, precision: str
) -> None:
    """A run in FP8/FP4 rollout precision (delta sync): every version a worker adopts is reported and matches
    the trainer's digest, and the run completes with full accounting."""
    cfg = small_run_config(
        model_cache, f"q{precision[:3]}", **{"sync.dtype": precision, "sync.mode": "delta", "sync.anchor_every": 3}
    )
    cluster = run_to_completion(cfg, tmp_path / "run", server.url)
    summary = cluster.summary()
    assert summary["steps"] == cfg.trainer.steps and summary["dead_lettered"] == 0
    check_held_weights(cluster)  # every worker reported, every report matches the trainer's quantized state
    published = [json.loads(line) for line in cluster.log("trainer-0").splitlines() if "weights_" in line]
    assert any(p.get("event") == "weights_published" and p.get("mode") == "delta" for p in published)
