"""Which device each process of a run computes on, decided from the config before anything touches CUDA.

On one machine (``miles run``) the trainer ranks take GPUs ``0 .. ranks-1`` (``distributed`` sets rank ``r`` on
GPU ``r``), and the rollout workers whose engine runs in their own process on CUDA (the torch engine) take the
next ones, one each (:func:`local_gpus`), so no worker lands on a trainer's GPU. Inference servers (vLLM,
SGLang) choose their GPUs themselves. A process pins its device (:func:`pin`) before it loads a model or joins
a process group: NCCL binds a communicator to the current device, which is where the weight-update group's
members meet (``miles/sync/transport/broadcast.py``).

``miles-node`` on other machines: ``--gpu K`` names the local GPU of a process whose config says ``cuda``
without an index (``rollout.engine.device: cuda``); without it such a process uses GPU 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.config import RunConfig


class DevicePlanError(ValueError):
    """The run wants more GPUs on this machine than it has (one line, naming who wants what)."""


def trainer_on_cuda(cfg: RunConfig) -> bool:
    """The trainer computes on CUDA: FSDP with ``trainer.backend.device`` cuda, or Megatron (GPU only)."""
    backend = cfg.trainer.backend
    return backend.type == "megatron" or str(getattr(backend, "device", "cpu")).startswith("cuda")


def engine_on_cuda(cfg: RunConfig) -> bool:
    """The rollout workers' engine computes in their own process on CUDA (the torch engine on cuda)."""
    engine = cfg.rollout.engine
    return engine.type == "torch" and engine.device.startswith("cuda")


def local_gpus(cfg: RunConfig, available: int) -> dict[str, int]:
    """Actor id -> local GPU for the processes of a run on one machine with ``available`` GPUs: trainer ranks
    first, then each CUDA rollout worker on a GPU of its own. :class:`DevicePlanError` if they do not fit."""
    plan: dict[str, int] = {}
    if trainer_on_cuda(cfg):
        plan |= {f"trainer-{rank}": rank for rank in range(cfg.trainer.ranks)}
    if engine_on_cuda(cfg) and ":" not in cfg.rollout.engine.device:  # 'cuda:N' pins every worker itself
        plan |= {f"rollout-{i}": len(plan) + i for i in range(cfg.rollout.workers)}
    if plan and max(plan.values()) >= available:
        wanted = ", ".join(f"{actor} on GPU {gpu}" for actor, gpu in plan.items())
        raise DevicePlanError(f"this run needs {max(plan.values()) + 1} GPUs ({wanted}); {available} visible")
    return plan


def process_device(requested: str, gpu: int | None) -> str:
    """The device of a process whose config asks for ``requested`` ('cpu', 'cuda' or 'cuda:N'): a bare 'cuda'
    becomes 'cuda:<gpu>' (``--gpu``; 0 when not given), anything else stays as it is."""
    if requested == "cuda":
        return f"cuda:{gpu or 0}"
    return requested


def pin(device: str) -> None:
    """Make ``device`` this process's current CUDA device (nothing for CPU): before a model is loaded on it and
    before a process group is joined, so both use that GPU."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))
