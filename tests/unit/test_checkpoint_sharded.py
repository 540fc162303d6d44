"""DCP checkpoints in one process without a process group (an unsharded model), through the manager."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from miles.backends.fsdp_checkpoint import SaveHandle, load_sharded, save_sharded
from miles.training.checkpoint import CheckpointManager


def tiny(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    return LlamaForCausalLM(cfg)


def trained() -> tuple[LlamaForCausalLM, torch.optim.Optimizer]:
    model = tiny(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    return model, opt


class Backend:
    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def save_checkpoint(self, path: str, *, asynchronous: bool = False) -> SaveHandle | None:
        return save_sharded(self.model, self.opt, path, asynchronous=asynchronous, extra={"steps_done": 1})

    def load_checkpoint(self, path: str) -> Any:
        return load_sharded(self.model, self.opt, path)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_manager_round_trip_restores_model_and_optimizer(tmp_path: Path, asynchronous: bool) -> None:
    model, opt = trained()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v["exp_avg"].clone() for k, v in opt.state_dict()["state"].items()}
    manager = CheckpointManager(tmp_path, every=1, keep=1, asynchronous=asynchronous)
    manager.save(1, Backend(model, opt), {"policy_version": 1})
    with torch.no_grad():  # training goes on at once: an async checkpoint holds the staged copy
        for p in model.parameters():
            p.zero_()
    manager.close()

    fresh = tiny(5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert CheckpointManager(tmp_path, every=1, keep=1).load_latest(Backend(fresh, fresh_opt)) == (
        1,
        {"policy_version": 1},
    )
    for name, value in expected.items():
        assert torch.equal(fresh.state_dict()[name], value), name
    got = fresh_opt.state_dict()["state"]
    assert all(torch.equal(got[k]["exp_avg"], v) for k, v in moments.items())
