"""Sharded DCP checkpoints of FSDP2 models: 2 ranks -> 1, 1 -> 2, LoRA adapters only, async saves.

Every case trains a tiny random Llama with a plain next-token loss, checkpoints it, restores it on another
rank count and checks that the *next* step's loss on the same batch (model restored) and the loss after
that step (optimizer state restored) match the run that never stopped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from miles.backends.distributed import distributed, spawn_ranks
from miles.backends.fsdp_checkpoint import load_sharded, save_sharded, saved_keys
from miles.config import LoraConfig
from miles.ports import free_port
from miles.sync.lora import add_adapters
from miles.training.checkpoint import CheckpointManager

VOCAB = 48
LORA = LoraConfig(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"])
RTOL = 1e-4


def tiny(seed: int = 0, lora: bool = False) -> torch.nn.Module:
    """A 2-layer Llama; with ``lora`` its embeddings are tied, as in SmolLM2, whose tied lm_head a LoRA
    checkpoint must not carry."""
    torch.manual_seed(0)  # the same base in every process
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=lora,
        )
    )
    torch.manual_seed(seed)  # different adapters / a different start for restored models
    if lora:
        model = add_adapters(model, LORA)
    elif seed:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    return model.eval()


def shard(model: torch.nn.Module) -> torch.nn.Module:
    if not dist.is_initialized():
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(step))  # (B, T)


def local(x: torch.Tensor) -> torch.Tensor:
    """This rank's rows (equal token counts per rank, so FSDP's gradient average is the global mean's)."""
    if not dist.is_initialized():
        return x
    return x.chunk(dist.get_world_size())[dist.get_rank()]


def global_mean(value: torch.Tensor) -> float:
    value = value.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    x = local(batch(step))
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return global_mean(loss)


@torch.no_grad()
def eval_loss(model: torch.nn.Module, step: int) -> float:
    x = local(batch(step))
    return global_mean(model(input_ids=x, labels=x).loss)


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full copies of the trainable parameters (a gather per DTensor: collective)."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = full.detach().clone()
    return out


def continuation(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, float]:
    """Step 2's loss (the restored weights) and the loss after it (the restored optimizer state)."""
    return {"next": train_step(model, opt, 2), "after": eval_loss(model, 3)}


class Backend:
    """The checkpoint half of a TrainBackend, as the FSDP backend will provide it."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, adapter_only: bool = False) -> None:
        self.model, self.opt, self.adapter_only, self.steps_done = model, opt, adapter_only, 0

    def save_checkpoint(self, path: str, *, asynchronous: bool = False) -> Any:
        extra = {"steps_done": self.steps_done}
        return save_sharded(
            self.model, self.opt, path, adapter_only=self.adapter_only, asynchronous=asynchronous, extra=extra
        )

    def load_checkpoint(self, path: str) -> None:
        self.steps_done = load_sharded(self.model, self.opt, path, adapter_only=self.adapter_only)["steps_done"]


def _two_rank_main(rank: int, world_size: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    with distributed(rank, world_size, "127.0.0.1", port, timeout_s=120):
        # Full fine-tuning, synchronous save through the manager.
        model = shard(tiny())
        opt = optimizer(model)
        backend = Backend(model, opt)
        train_step(model, opt, 1)
        backend.steps_done = 1
        manager = CheckpointManager(Path(out) / "full", every=1, keep=2)
        manager.save(1, backend, {"policy_version": 1})
        results["full_weights"] = trainable(model)
        results["full"] = continuation(model, opt)

        # Asynchronous: the live weights change right after staging; the checkpoint must not.
        model = shard(tiny())
        opt = optimizer(model)
        backend = Backend(model, opt)
        train_step(model, opt, 1)
        async_manager = CheckpointManager(Path(out) / "async", every=1, keep=2, asynchronous=True)
        async_manager.save(1, backend, {"policy_version": 1})
        results["async"] = continuation(model, opt)  # runs while the write may still be in flight
        async_manager.close()

        # LoRA: only the adapters and their optimizer state.
        model = shard(tiny(lora=True))
        opt = optimizer(model)
        train_step(model, opt, 1)
        save_sharded(model, opt, Path(out) / "lora", adapter_only=True)
        results["lora_weights"] = trainable(model)
        results["lora"] = continuation(model, opt)
    torch.save(results, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("dcp2")
    spawn_ranks(_two_rank_main, 2, 2, free_port(), str(out))
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert all(results[0][k] == results[1][k] for k in ("full", "async", "lora"))  # global means
    return out, results[0]


def restored(path: Path, lora: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model = tiny(seed=7, lora=lora)
    opt = optimizer(model)
    extra = load_sharded(model, opt, path, adapter_only=lora)
    return model, opt, extra


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_two_rank_checkpoint_loads_on_one_rank(two_rank_run: tuple[Path, dict[str, Any]]) -> None:
    out, results = two_rank_run
    manager = CheckpointManager(out / "full", every=1, keep=2)
    path, extra = manager.latest()  # type: ignore[misc]
    assert extra == {"policy_version": 1}
    assert sorted(p.name for p in path.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    model, opt, backend_extra = restored(path)
    assert backend_extra == {"steps_done": 1}
    assert_same(trainable(model), results["full_weights"])
    got = continuation(model, opt)
    assert got["next"] == pytest.approx(results["full"]["next"], rel=RTOL)
    assert got["after"] == pytest.approx(results["full"]["after"], rel=RTOL)


def test_async_checkpoint_is_the_staged_state(two_rank_run: tuple[Path, dict[str, Any]]) -> None:
    out, results = two_rank_run
    path, _ = CheckpointManager(out / "async", every=1, keep=2).latest()  # type: ignore[misc]
    model, opt, _ = restored(path)
    got = continuation(model, opt)
    assert got["next"] == pytest.approx(results["async"]["next"], rel=RTOL)
    assert got["after"] == pytest.approx(results["async"]["after"], rel=RTOL)


def test_lora_checkpoint_holds_only_adapters(two_rank_run: tuple[Path, dict[str, Any]]) -> None:
    out, results = two_rank_run
    keys = saved_keys(out / "lora")
    model_keys = [k for k in keys if k.startswith("model.")]
    state_keys = [k for k in keys if k.startswith("optim.state.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    assert state_keys and all(".lora_A." in k or ".lora_B." in k for k in state_keys)
    model, opt, _ = restored(out / "lora", lora=True)
    assert_same(trainable(model), results["lora_weights"])
    got = continuation(model, opt)
    assert got["next"] == pytest.approx(results["lora"]["next"], rel=RTOL)
    assert got["after"] == pytest.approx(results["lora"]["after"], rel=RTOL)


def _load_two_rank_main(rank: int, world_size: int, port: int, ckpt: str, out: str) -> None:
    torch.set_num_threads(1)
    with distributed(rank, world_size, "127.0.0.1", port, timeout_s=120):
        model = shard(tiny(seed=5))
        opt = optimizer(model)
        load_sharded(model, opt, ckpt)
        result = continuation(model, opt)
    torch.save(result, Path(out) / f"load{rank}.pt")


def test_one_rank_checkpoint_loads_on_two_ranks(tmp_path: Path) -> None:
    model = tiny()
    opt = optimizer(model)
    train_step(model, opt, 1)
    save_sharded(model, opt, tmp_path / "one")
    expected = continuation(model, opt)
    spawn_ranks(_load_two_rank_main, 2, 2, free_port(), str(tmp_path / "one"), str(tmp_path))
    for rank in range(2):
        got = torch.load(tmp_path / f"load{rank}.pt")
        assert got["next"] == pytest.approx(expected["next"], rel=RTOL)
        assert got["after"] == pytest.approx(expected["after"], rel=RTOL)


def test_load_refuses_a_reference_mismatch(tmp_path: Path) -> None:
    model = tiny()
    opt = optimizer(model)
    save_sharded(model, opt, tmp_path / "ck", reference=tiny(seed=3))
    fresh = tiny()
    with pytest.raises(ValueError, match="reference"):
        load_sharded(fresh, optimizer(fresh), tmp_path / "ck")
    ref = tiny(seed=9)
    load_sharded(model, opt, tmp_path / "ck", reference=ref)
    assert torch.equal(ref.lm_head.weight, tiny(seed=3).lm_head.weight)
    with pytest.raises(TypeError, match="flat scalar"):
        save_sharded(model, opt, tmp_path / "bad", extra={"nested": {"a": 1}})  # type: ignore[dict-item]
