"""Held-out evaluation of published weights, run by the trainer leader.

It evaluates exactly the rollout-precision weights that workers receive (greedy decoding), so
the reported accuracy is that of the deployed policy, not of the trainer's fp32 master copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from miles.config import RunConfig, TorchEngineConfig


@dataclass(slots=True)
class Evaluator:
    engine: Any
    tokenizer: Any
    task: Any
    samples: list
    max_new_tokens: int

    @classmethod
    def create(cls, cfg: RunConfig) -> Evaluator:
        from miles.engines.registry import build_engine
        from miles.models.loading import load_tokenizer, resolve_model_dir
        from miles.tasks.registry import build_task

        model_dir = resolve_model_dir(cfg.model, cfg.task)
        engine_cfg = cfg.rollout.engine if isinstance(cfg.rollout.engine, TorchEngineConfig) else TorchEngineConfig()
        engine = build_engine(engine_cfg, model_dir, 0, cfg.seed)
        task = build_task(cfg.task)
        return cls(
            engine=engine,
            tokenizer=load_tokenizer(model_dir),
            task=task,
            samples=task.samples("eval"),
            max_new_tokens=cfg.rollout.sampling.max_new_tokens,
        )

    def evaluate(self, weights: dict[str, torch.Tensor], version: int) -> tuple[float, int]:
        from miles.tasks.evaluate import evaluate

        self.engine.load_weights(weights, version)
        accuracy = evaluate(self.engine, self.tokenizer, self.task, self.samples, self.max_new_tokens)
        return float(accuracy), len(self.samples)
