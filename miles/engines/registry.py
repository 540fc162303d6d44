"""Build the engine a config names (``cfg.type``)."""

from __future__ import annotations

import json
from pathlib import Path

from miles.config import LoraConfig, SglangEngineConfig, TorchEngineConfig, VllmEngineConfig
from miles.engines.base import Engine, StagingEngine
from miles.plugins import Registry

ENGINES: Registry[Engine] = Registry("engine")  # factory(cfg, model_dir, version, seed, work_dir)


@ENGINES.register("torch")
def _torch(
    cfg: TorchEngineConfig, model_dir: str | Path, version: int, seed: int | None, work_dir: Path | None
) -> Engine:
    import torch

    from miles.engines.torch_engine import TorchEngine
    from miles.models.loading import load_policy

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    model, tokenizer = load_policy(model_dir, cfg.dtype, cfg.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return TorchEngine(model, pad_token_id=pad if isinstance(pad, int) else 0, cfg=cfg, version=version, seed=seed)


@ENGINES.register("sglang")
def _sglang(
    cfg: SglangEngineConfig, model_dir: str | Path, version: int, seed: int | None, work_dir: Path | None
) -> Engine:
    from miles.engines.sglang_engine import SglangEngine

    max_context = cfg.max_context or checkpoint_context(model_dir)
    return SglangEngine(cfg, version=version, max_context=max_context)


@ENGINES.register("vllm")
def _vllm(
    cfg: VllmEngineConfig, model_dir: str | Path, version: int, seed: int | None, work_dir: Path | None
) -> Engine:
    from miles.engines.vllm.engine import VllmEngine

    if work_dir is None:
        raise ValueError("a vllm engine needs work_dir (its weight files and server log)")
    max_context = cfg.max_context or checkpoint_context(model_dir) or 2048
    return VllmEngine(
        cfg,
        model_dir,
        version=version,
        weights_dir=work_dir / "weights",
        log_path=work_dir / "vllm.log",
        max_context=max_context,
    )


def build_engine(
    cfg: TorchEngineConfig | SglangEngineConfig | VllmEngineConfig,
    model_dir: str | Path,
    version: int = 0,
    seed: int | None = None,
    *,
    work_dir: str | Path | None = None,
) -> Engine:
    """An engine (not started) serving the checkpoint in ``model_dir`` at policy ``version``.

    For ``torch`` the model is loaded here (and ``cfg.threads`` applied to this process, since torch's
    intra-op pool is per process); ``seed`` seeds its sampling. For ``sglang`` the server already holds
    the model; ``model_dir`` only supplies the context window when ``cfg`` does not, and ``seed`` is unused.
    For ``vllm`` the engine starts (or joins) its server in ``start()``; ``work_dir`` holds its weight files and
    server log (``seed`` is the server's ``cfg.seed``).
    """
    work = None if work_dir is None else Path(work_dir)
    return ENGINES.factory(cfg.type)(cfg, model_dir, version, seed, work)


def build_staging_engine(
    cfg: TorchEngineConfig | SglangEngineConfig | VllmEngineConfig,
    model_dir: str | Path,
    seed: int | None,
    *,
    work_dir: str | Path,
    lora: LoraConfig | None = None,
) -> StagingEngine:
    """The engine a rollout worker stages published weights into, at version -1 (it generates nothing until
    it holds a verified version). An SGLang server loads from disk: wrapped in
    :class:`~miles.engines.sglang_staging.SglangStagingEngine`, which writes each version (or, with ``lora``,
    each adapter) under ``cfg.adapter_dir`` or ``work_dir/weights``."""
    engine = build_engine(cfg, model_dir, -1, seed, work_dir=work_dir)
    if isinstance(cfg, SglangEngineConfig):
        from miles.engines.sglang_engine import SglangEngine
        from miles.engines.sglang_staging import SglangStagingEngine

        assert isinstance(engine, SglangEngine)
        weights_dir = cfg.adapter_dir or Path(work_dir) / "weights"
        return SglangStagingEngine(engine, weights_dir, lora=lora, model_dir=model_dir)
    if isinstance(cfg, VllmEngineConfig) and lora is not None:
        from miles.engines.vllm.engine import VllmEngine

        assert isinstance(engine, VllmEngine)
        engine.serve_adapters(lora)  # the server applies the adapters: only they are written per version
    return engine  # type: ignore[return-value]  # the torch and vLLM engines stage themselves


def checkpoint_context(model_dir: str | Path) -> int | None:
    """``max_position_embeddings`` from ``model_dir/config.json`` (or its ``text_config``); None if absent."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    for section in (config, config.get("text_config") or {}):
        value = section.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None
