"""The megatron-core training backend (``trainer.backend.type: megatron``); docs/megatron.md.

Importing this package imports neither torch nor megatron-core: :func:`megatron_unavailable_reason` is the
start-up check (one line naming what is missing, or None), :func:`build_megatron_backend` builds the
backend on a trainer rank. Modules: ``settings`` (the backend config as one value), ``config`` (HF config
-> megatron-core config, pure), ``converters/`` (HF <-> megatron tensors per family), ``model`` (building
and loading), ``batches`` / ``logprobs`` / ``forward`` (one micro-batch through megatron's schedule),
``export`` (streaming HF tensors out), ``checkpoint`` (dist_checkpointing), ``backend`` (the
``TrainBackend``), ``compat`` / ``cpu_shims`` (megatron-core gaps; CPU contract tests).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.backends.base import TrainBackend
    from miles.config import RunConfig

MEGATRON_CORE = "megatron-core"


def megatron_unavailable_reason(cfg: RunConfig) -> str | None:
    """None when ``cfg`` can train with megatron-core here, else one line naming what is missing.

    Checked in order: the ``megatron`` extra, a CUDA GPU, the parallel layout against ``trainer.ranks``,
    features this backend does not offer (LoRA), TransformerEngine where the layout needs it, and, for a
    pretrained model, that its architecture has a converter. Cheap: no model is loaded.
    """
    backend = cfg.trainer.backend
    if backend.type != "megatron":
        return None
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return f"trainer.backend.type=megatron needs {MEGATRON_CORE}: pip install 'miles[megatron]'"
    import torch

    if not torch.cuda.is_available():
        return "trainer.backend.type=megatron needs a CUDA GPU (none is visible); use trainer.backend.type=fsdp"
    from miles.backends.megatron.settings import MegatronSettings

    try:
        settings = MegatronSettings.from_backend_config(backend, seed=cfg.trainer.seed)
        settings.data_parallel_size(cfg.trainer.ranks)
    except ValueError as exc:
        return f"trainer.backend: {exc}"
    if cfg.trainer.lora is not None:
        return "trainer.lora is not supported by trainer.backend.type=megatron (use fsdp for LoRA)"
    te = importlib.util.find_spec("transformer_engine") is not None
    if (settings.context_parallel > 1 or settings.packing == "thd") and not te:
        return "context_parallel > 1 and packing=thd need transformer-engine (pip install transformer-engine[pytorch])"
    if settings.transformer_engine == "on" and not te:
        return "trainer.backend.transformer_engine=on but transformer-engine is not installed"
    fused_norm = te or importlib.util.find_spec("apex") is not None
    return _model_reason(cfg, moe_tp_ok=settings.tensor_parallel == 1 or (settings.sequence_parallel and fused_norm))


def _model_reason(cfg: RunConfig, *, moe_tp_ok: bool) -> str | None:
    """A pretrained model whose ``config.json`` this backend cannot reproduce (tiny models are Llama), or a
    MoE model under TP without sequence parallelism (megatron-core refuses to train that)."""
    if cfg.model.type != "pretrained":
        return None
    from miles.backends.megatron.config import UnsupportedModelError, translate

    path = Path(cfg.model.path) / "config.json"
    if not path.is_file():
        return None  # model loading reports a missing checkpoint itself
    try:
        args = translate(json.loads(path.read_text()))
    except UnsupportedModelError as exc:
        return f"trainer.backend.type=megatron cannot train {cfg.model.path}: {exc}"
    if args.num_experts and not moe_tp_ok:
        return "MoE with tensor_parallel > 1 needs sequence parallelism, i.e. transformer-engine (or apex) installed"
    return None


def build_megatron_backend(
    cfg: RunConfig, *, rank: int, world_size: int, master_addr: str, master_port: int
) -> tuple[TrainBackend, int]:
    """Join NCCL, load the policy from its HF checkpoint and wrap it (``build_backend``'s megatron branch);
    returns the backend and the pad token id."""
    reason = megatron_unavailable_reason(cfg)
    if reason is not None:
        raise RuntimeError(reason)
    import torch

    from miles.backends.distributed import init_distributed, is_distributed
    from miles.backends.megatron.backend import MegatronBackend
    from miles.models.loading import load_tokenizer, prepared_model_dir

    if not is_distributed():  # megatron-core always needs a process group, even for one rank
        init_distributed(rank, world_size, master_addr, master_port, device="cuda")
    torch.manual_seed(cfg.trainer.seed)
    model_dir = prepared_model_dir(cfg.model, cfg.task)
    tokenizer = load_tokenizer(model_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    temperature = cfg.rollout.sampling.temperature or 1.0
    return MegatronBackend(model_dir, int(pad or 0), cfg.trainer, temperature=temperature), int(pad or 0)


__all__ = ["build_megatron_backend", "megatron_unavailable_reason"]
