"""Delta sync from two FSDP2 ranks: each rank keeps only its own tensors' previous bits, the records it encodes
rebuild the new state bit for bit, and rank 0 never holds more than its share (miles/sync/owned_delta.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from miles.backends.distributed import distributed, spawn_ranks
from miles.backends.fsdp_export import export_specs, iter_full_params
from miles.bus.server import EmbeddedNats
from miles.ports import free_port
from miles.sync.delta import apply_state_delta, framed_record, state_delta_header
from miles.sync.owned_delta import OwnedBase, OwnedPlan, assign_owners, owned_export
from miles.sync.precision import to_rollout_state
from miles.sync.stream_export import TensorSpec

from .harness import check_held_weights, run_to_completion, small_run_config


def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(cfg).eval()


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _main(rank: int, world_size: int, port: int, out: str, precision: str) -> None:
    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    with distributed(rank, world_size, "127.0.0.1", port, timeout_s=120):
        model = shard(tiny())
        plan = OwnedPlan.of(export_specs(model), precision, None, world_size)
        base = OwnedBase()
        versions: list[dict[str, torch.Tensor]] = []
        payloads: list[bytes] = []
        for version in range(3):
            items = list(owned_export(iter_full_params(model, dst=0), plan, base, rank=rank, anchor=version == 0))
            if rank == 0:
                versions.append({item.spec.name: item.tensor.clone() for item in items})
                if version:
                    names = [item.spec.name for item in items]
                    records = [framed_record(item.record or b"") for item in items]
                    payloads.append(state_delta_header(version - 1, version, names) + b"".join(records))
                else:
                    assert all(item.record is None for item in items)
            # Rank 0's independent view of the state just published, for the check below.
            full = {name: t.clone() for name, t in iter_full_params(model, dst=0)}
            if rank == 0:
                result.setdefault("expected", []).append(to_rollout_state(full, precision))
            with torch.no_grad():  # an "optimizer step" that moves a few rollout-precision bits
                for p in model.parameters():
                    p.mul_(1.003)
        result["owned"] = sorted(base.tensors)
        result["owned_bytes"] = base.nbytes
        result["share"] = plan.share(rank)
        result["versions"] = versions
        result["payloads"] = payloads
    torch.save(result, Path(out) / f"rank{rank}.pt")


@pytest.mark.parametrize("precision", ["bfloat16", "fp8_e4m3"])
def test_two_ranks_each_keep_their_share_and_the_records_rebuild_the_state(tmp_path: Path, precision: str) -> None:
    spawn_ranks(_main, 2, 2, free_port(), str(tmp_path), precision)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    zero = ranks[0]
    names = set(zero["versions"][0])
    # Every tensor is owned by exactly one rank, and each rank holds exactly its planned share, about half.
    assert set(ranks[0]["owned"]) | set(ranks[1]["owned"]) == names
    assert not set(ranks[0]["owned"]) & set(ranks[1]["owned"])
    total = sum(r["owned_bytes"] for r in ranks)
    for r in ranks:
        assert r["owned_bytes"] == r["share"]
        assert r["owned_bytes"] < 0.6 * total
    # What rank 0 published is the rollout-precision state, and each delta rebuilds the next one bit for bit.
    for got, expected in zip(zero["versions"], zero["expected"], strict=True):
        assert set(got) == set(expected)
        for name in got:
            assert torch.equal(bits(got[name]), bits(expected[name])), name
    state = zero["versions"][0]
    for version, payload in enumerate(zero["payloads"], start=1):
        state = apply_state_delta(state, payload, version - 1)
        for name, tensor in zero["versions"][version].items():
            assert torch.equal(bits(state[name]), bits(tensor)), name


def test_owners_balance_bytes_and_agree_on_every_rank() -> None:
    specs = [TensorSpec(f"t{i}", torch.bfloat16, (n,)) for i, n in enumerate([100, 60, 50, 40, 30, 20, 10])]
    owners = assign_owners(specs, 3)
    assert owners == assign_owners(list(reversed(specs)), 3)  # the same map whatever the order given
    load = [sum(s.nbytes for s in specs if owners[s.name] == r) for r in range(3)]
    assert max(load) - min(load) <= 2 * 40  # greedy largest-first: within the largest remaining tensor


@pytest.mark.slow
def test_a_two_rank_trainer_publishes_deltas_that_every_worker_verifies(
    tmp_path: Path, server: EmbeddedNats, model_cache: Path
) -> None:
    """The real trainer in sync.mode delta on two ranks (processes, a real nats-server): deltas go out, and every
    version a worker adopted matches the trainer's digest."""
    cfg = small_run_config(model_cache, "odelta", **{"sync.mode": "delta", "sync.anchor_every": 3})
    cluster = run_to_completion(cfg, tmp_path / "run", server.url, ranks=2)
    summary = cluster.summary()
    assert summary["steps"] == cfg.trainer.steps and summary["dead_lettered"] == 0
    check_held_weights(cluster)
    events = [json.loads(line) for line in cluster.log("trainer-0").splitlines() if "weights_published" in line]
    modes = [e.get("mode") for e in events if e.get("event") == "weights_published"]
    assert modes.count("delta") >= cfg.trainer.steps // 2 and modes[0] == "full"


@pytest.mark.slow
def test_a_sync_mode_of_your_own_drives_a_real_run(tmp_path: Path, server: EmbeddedNats, model_cache: Path) -> None:
    """A mode registered by a recipe's plugin module (tests/integration/checkpoint_anchors.py) is what the real
    trainer publishes with: anchors at its checkpoint versions, deltas between, every held version verified."""
    sets = {"plugins": ["tests.integration.checkpoint_anchors"], "sync.mode": "checkpoint_anchors"}
    cfg = small_run_config(model_cache, "ownmode", **sets, **{"sync.anchor_every": 100})
    cluster = run_to_completion(cfg, tmp_path / "run", server.url)
    assert cluster.summary()["steps"] == cfg.trainer.steps
    check_held_weights(cluster)
    events = [json.loads(line) for line in cluster.log("trainer-0").splitlines() if "weights_" in line]
    published = {e["version"]: e["mode"] for e in events if e.get("event") == "weights_published"}
    anchors = {e["version"]: e["reason"] for e in events if e.get("event") == "weights_anchor_published"}
    every = cfg.trainer.checkpoint_every
    assert set(published) == set(range(cfg.trainer.steps + 1))
    assert {v for v, mode in published.items() if mode == "delta"} == {v for v in published if v % every}
    assert anchors == {v: "no_previous_state" if v == 0 else "checkpoint" for v in published if v % every == 0}
