"""Build the engine a config names (``cfg.type``)."""

from __future__ import annotations

from pathlib import Path

from miles.config import SglangEngineConfig, TorchEngineConfig
from miles.engines.base import Engine


def build_engine(
    cfg: TorchEngineConfig | SglangEngineConfig, model_dir: str | Path, version: int = 0, seed: int | None = None
) -> Engine:
    """An engine serving the checkpoint in ``model_dir`` at policy ``version``.

    For ``torch`` the model is loaded here (and ``cfg.threads`` applied to this process, since torch's
    intra-op pool is per process); ``seed`` seeds its sampling. For ``sglang`` the server already holds
    the model, so ``model_dir`` and ``seed`` are unused.
    """
    if cfg.type == "torch":
        import torch

        from miles.engines.torch_engine import TorchEngine
        from miles.models.loading import load_policy

        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        model, tokenizer = load_policy(model_dir, cfg.dtype, cfg.device)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        from miles.engines._compat import AsyncBatchAdapter

        inner = TorchEngine(model, pad_token_id=pad if isinstance(pad, int) else 0, cfg=cfg, version=version, seed=seed)
        return AsyncBatchAdapter(inner)
    if cfg.type == "sglang":
        from miles.engines.sglang_engine import SglangEngine

        return SglangEngine(cfg, version=version)
    raise ValueError(f"unknown engine type {cfg.type!r}")
