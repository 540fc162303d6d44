"""Model and optimizer state through megatron-core's distributed checkpointing (``dist_checkpointing``).

Every rank writes only its shards; the files describe tensors in global coordinates, so a checkpoint
written under one layout loads under another where megatron-core can reshard: model weights across TP,
PP and EP changes, and the distributed optimizer's state with the ``fully_reshardable`` format (chosen
here for that reason; it gathers optimizer state over the data-parallel group while saving, which costs
time on very large runs, where ``dp_reshardable`` would be the faster, DP-only choice). Stream positions,
versions and the learning-rate clock are the trainer's, not part of this state. The reference policy is
not saved: it is the HF checkpoint, reloaded at start-up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist

from miles.backends.megatron.model import unwrap

log = structlog.get_logger(__name__)
SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}
FORMAT = 1
INFO_FILE = "miles_megatron.json"


def _model_keys(chunks: list[torch.nn.Module]) -> list[str]:
    """``model`` for one chunk, ``model0``, ``model1``, ... with virtual pipeline stages (megatron's names)."""
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def sharded_state(chunks: list[torch.nn.Module], optimizer: Any | None, *, is_loading: bool) -> dict[str, Any]:
    """The sharded state dict of the chunks (and the optimizer, when given)."""
    state: dict[str, Any] = {
        key: unwrap(chunk).sharded_state_dict(metadata=SHARDING) for key, chunk in zip(_model_keys(chunks), chunks)
    }
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=SHARDING)
    return state


def save(path: str, chunks: list[torch.nn.Module], optimizer: Any | None, info: dict[str, Any]) -> None:
    """Write this rank's shards under directory ``path`` (created by rank 0). Collective."""
    from megatron.core import dist_checkpointing

    target = Path(path)
    if dist.get_rank() == 0:
        target.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sharded_state(chunks, optimizer, is_loading=False), str(target))
    if dist.get_rank() == 0:
        (target / INFO_FILE).write_text(json.dumps({"format": FORMAT, **info}, indent=2))
    dist.barrier()
    log.info("megatron.checkpoint_saved", path=str(target))


def load(path: str, chunks: list[torch.nn.Module], optimizer: Any | None) -> dict[str, Any]:
    """Restore the chunks (and optimizer) from ``path``; returns the info rank 0 wrote. Collective."""
    from megatron.core import dist_checkpointing

    target = Path(path)
    info_path = target / INFO_FILE
    if not info_path.is_file():
        raise FileNotFoundError(f"{target}: not a Miles Megatron checkpoint (no {INFO_FILE})")
    info = json.loads(info_path.read_text())
    if info.get("format") != FORMAT:
        raise ValueError(f"{target}: checkpoint format {info.get('format')}, expected {FORMAT}")
    state = dist_checkpointing.load(sharded_state(chunks, optimizer, is_loading=True), str(target))
    for key, chunk in zip(_model_keys(chunks), chunks):
        unwrap(chunk).load_state_dict(state[key], strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    log.info("megatron.checkpoint_loaded", path=str(target))
    return info
