"""Held-out evaluation of published weights, run by the trainer leader.

It evaluates exactly the rollout-precision weights that workers receive (greedy decoding), so
the reported accuracy is that of the deployed policy, not of the trainer's fp32 master copy: the
published state (FP8/FP4 codes, a LoRA adapter) is decoded for its engine exactly as a rollout
worker decodes it (:class:`miles.sync.engine_weights.EngineWeights`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from miles.config import RunConfig, TorchEngineConfig
from miles.sync.engine_weights import EngineWeights
from miles.sync.lora import lora_scale


@dataclass(slots=True)
class Evaluator:
    engine: Any
    tokenizer: Any
    task: Any
    samples: list
    max_new_tokens: int
    weights: EngineWeights

    @classmethod
    def create(cls, cfg: RunConfig) -> Evaluator:
        from miles.engines.registry import build_engine
        from miles.models.loading import load_tokenizer, resolve_model_dir
        from miles.tasks.registry import build_task

        model_dir = resolve_model_dir(cfg.model, cfg.task)
        engine_cfg = cfg.rollout.engine if isinstance(cfg.rollout.engine, TorchEngineConfig) else TorchEngineConfig()
        engine = build_engine(engine_cfg, model_dir, 0, cfg.seed)
        lora = cfg.trainer.lora if cfg.sync.mode == "lora" else None
        weights = EngineWeights(
            engine.model.state_dict, precision=cfg.sync.dtype, lora_scale=None if lora is None else lora_scale(lora)
        )
        task = build_task(cfg.task)
        return cls(
            engine=engine,
            tokenizer=load_tokenizer(model_dir),
            task=task,
            samples=task.samples("eval"),
            max_new_tokens=cfg.rollout.sampling.max_new_tokens,
            weights=weights,
        )

    def evaluate(self, published: dict[str, torch.Tensor], version: int) -> tuple[float, int]:
        """Greedy held-out accuracy of the published state ``published`` (as the trainer published it)."""
        from miles.tasks.evaluate import evaluate

        state, complete = self.weights.decode(published)
        self.engine.load_weights(state, version, complete=complete)
        accuracy = evaluate(self.engine, self.tokenizer, self.task, self.samples, self.max_new_tokens)
        return float(accuracy), len(self.samples)
