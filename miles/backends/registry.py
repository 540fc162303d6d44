"""Build the training backend a config names (``trainer.backend.type``) on this rank."""

from __future__ import annotations

from miles.backends.base import TrainBackend
from miles.config import RunConfig
from miles.plugins import Registry


class BackendUnavailable(RuntimeError):
    """The configured backend cannot run here (no GPU, a missing extra); the message names what is missing."""


BACKENDS: Registry[tuple[TrainBackend, int]] = Registry("training backend")  # factory(cfg, rank, world, addr, port)


def build_backend(
    cfg: RunConfig, *, rank: int, world_size: int, master_addr: str, master_port: int
) -> tuple[TrainBackend, int]:
    """Join the trainer's process group, load the prepared policy and wrap it for training; returns the backend
    and the pad token id."""
    return BACKENDS.factory(cfg.trainer.backend.type)(cfg, rank, world_size, master_addr, master_port)


@BACKENDS.register("megatron")
def _megatron(
    cfg: RunConfig, rank: int, world_size: int, master_addr: str, master_port: int
) -> tuple[TrainBackend, int]:
    from miles.backends.megatron import build_megatron_backend, megatron_unavailable_reason

    reason = megatron_unavailable_reason(cfg)
    if reason is not None:
        raise BackendUnavailable(reason)
    return build_megatron_backend(
        cfg, rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port
    )


@BACKENDS.register("fsdp")
def _fsdp(cfg: RunConfig, rank: int, world_size: int, master_addr: str, master_port: int) -> tuple[TrainBackend, int]:
    """A one-rank trainer with float32 parameters joins no group: FSDP2 on one rank shards nothing, and its hooks
    and the all-reduce of every metric cost a fifth of the quickstart's step (benchmarks/RESULTS.md). With
    bfloat16 parameters it joins a one-rank group, since mixed precision is FSDP2's (MixedPrecisionPolicy).
    Checkpoints are the same DCP format either way, and load onto any rank count."""
    import torch

    from miles.backends.distributed import init_distributed
    from miles.backends.fsdp import FsdpBackend
    from miles.models.loading import load_policy, prepared_model_dir
    from miles.ports import free_port

    backend_cfg = cfg.trainer.backend
    if world_size > 1 or backend_cfg.param_dtype != "float32":
        port = master_port if world_size > 1 else free_port()  # one rank: no rendezvous to agree on
        host = master_addr if world_size > 1 else "127.0.0.1"
        init_distributed(rank, world_size, host, port, device=backend_cfg.device)
    torch.manual_seed(cfg.trainer.seed)
    model_dir = prepared_model_dir(cfg.model, cfg.task)
    model, tokenizer = load_policy(model_dir, "float32", backend_cfg.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    temperature = cfg.rollout.sampling.temperature or 1.0  # greedy rollouts: log-probs at T=1
    backend = FsdpBackend(model, cfg.trainer, rank, world_size, temperature=temperature)
    return backend, int(pad or 0)
