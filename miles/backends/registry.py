"""Build the training backend a config names (``trainer.backend.type``) on this rank."""

from __future__ import annotations

from miles.backends.base import TrainBackend
from miles.config import RunConfig


def build_backend(cfg: RunConfig, *, rank: int, world_size: int, master_addr: str, master_port: int) -> TrainBackend:
    """Join the process group (several ranks), load the policy and wrap it for training."""
    backend_cfg = cfg.trainer.backend
    if backend_cfg.type == "megatron":
        raise NotImplementedError(
            "trainer.backend.type=megatron needs GPUs and megatron-core (pip install 'miles[megatron]'); "
            "use trainer.backend.type=fsdp on CPU"
        )
    import torch

    from miles.backends.distributed import init_distributed
    from miles.backends.fsdp import FsdpBackend
    from miles.models.loading import load_policy, resolve_model_dir

    if world_size > 1:
        init_distributed(rank, world_size, master_addr, master_port, device=backend_cfg.device)
    torch.manual_seed(cfg.trainer.seed)
    model_dir = resolve_model_dir(cfg.model, cfg.task)
    model, tokenizer = load_policy(model_dir, "float32", backend_cfg.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    temperature = cfg.rollout.sampling.temperature or 1.0  # greedy rollouts: log-probs at T=1
    return FsdpBackend(model, int(pad or 0), cfg.trainer, rank, world_size, temperature=temperature)
