"""The weight sender's export for delta and LoRA sync: a state of its own, never the live parameters.

The publisher keeps the exported state as the base of the next delta. An unsharded FSDP backend yields its
live float32 parameters, so at a float32 sync an export that only casts would alias them: the optimizer's
in-place update would then move the base too, and the next delta would be computed against the new weights.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from miles.actors.trainer_ranks import LeaderRanks
from miles.backends.fsdp import FsdpBackend
from miles.config import load_config
from miles.sync.sender import WeightSender
from miles.training.rank_worker import RankWorker


def _tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=20,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("sync_dtype", ["float32", "bfloat16"])
async def test_export_is_not_aliased_to_the_live_parameters(sync_dtype: str, tmp_path: Path) -> None:
    cfg = load_config(None, ["sync.mode=delta", f"sync.dtype={sync_dtype}"])
    backend = FsdpBackend(_tiny(), cfg.trainer)
    ranks = LeaderRanks(RankWorker(backend, cfg, tmp_path, pad_id=0))
    sender = SimpleNamespace(cfg=cfg, ranks=ranks)  # the two attributes _collect reads
    try:
        exported = await WeightSender._collect(sender)  # type: ignore[arg-type]
        base = {name: t.clone() for name, t in exported.items()}
        live = dict(backend.model.lm.named_parameters())
        assert set(live) <= set(exported)
        with torch.no_grad():  # what the optimizer does: an in-place update of every parameter
            for p in live.values():
                p.add_(0.5)
        changed = [name for name, t in exported.items() if not torch.equal(t, base[name])]
        assert not changed, f"the exported state moved with the live parameters at {changed[:3]}"
        fresh = await WeightSender._collect(sender)  # type: ignore[arg-type]
        assert all(not torch.equal(fresh[name], exported[name]) for name in live)  # the update is exported
    finally:
        await ranks.stop()
