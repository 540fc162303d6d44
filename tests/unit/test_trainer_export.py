"""Delta sync's kept base on the trainer: a state of its own, never the live parameters.

Each rank keeps the previous bits of the tensors it owns as the base of the next delta. An unsharded FSDP
backend yields its live float32 parameters, so at a float32 sync a base that only casts would alias them:
the optimizer's in-place update would then move the base too, and the next delta would be computed against
the new weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from miles.backends.fsdp import FsdpBackend
from miles.config import load_config
from miles.sync.delta import apply_state_delta, framed_record, state_delta_header
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
def test_the_kept_base_is_not_aliased_to_the_live_parameters(sync_dtype: str, tmp_path: Path) -> None:
    cfg = load_config(None, ["sync.mode=delta", f"sync.dtype={sync_dtype}"])
    backend = FsdpBackend(_tiny(), cfg.trainer)
    worker = RankWorker(backend, cfg, tmp_path, pad_id=0)
    anchor = {item.spec.name: item.tensor.clone() for item in worker.owned_export(True)}
    base = {name: t.clone() for name, t in worker.delta_base.tensors.items()}
    live = dict(backend.model.lm.named_parameters())
    assert set(live) <= set(base) == set(anchor)  # one rank: it owns every tensor
    with torch.no_grad():  # what the optimizer does: an in-place update of every parameter
        for p in live.values():
            p.add_(0.5)
    changed = [name for name, t in worker.delta_base.tensors.items() if not torch.equal(t, base[name])]
    assert not changed, f"the kept base moved with the live parameters at {changed[:3]}"
    items = list(worker.owned_export(False))
    assert all(item.record for item in items)  # a delta against the kept base, not against itself
    new = {item.spec.name: item.tensor for item in items}
    payload = state_delta_header(0, 1, list(new)) + b"".join(framed_record(item.record or b"") for item in items)
    rebuilt = apply_state_delta(anchor, payload, 0)
    assert all(torch.equal(rebuilt[name], new[name]) for name in new)
    assert all(not torch.equal(new[name], anchor[name]) for name in live)  # the update is exported
