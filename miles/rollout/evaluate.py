"""Held-out evaluation: greedy episodes of a list of samples, scored like training episodes.

Used by rollout workers for the evaluation shards the controller sends (so the trainer never builds a second
model or waits for an evaluation) and by the tiny model's warm-up to know when to stop. Greedy, so that the
number is a property of the weights, not of sampling luck. A sample whose reward fails counts 0 and is
reported in ``failed``; an infrastructure failure likewise (``infra``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from miles.engines.base import Engine, SamplingParams
from miles.rollout.env import EpisodeSpec
from miles.rollout.episode import EpisodeLimits, run_episode
from miles.rollout.render import Renderer
from miles.tasks.base import Sample, Task


@dataclass(slots=True)
class EvalOutcome:
    samples: int = 0
    reward_sum: float = 0.0
    failed: int = 0
    infra: int = 0
    tokens: int = 0

    @property
    def accuracy(self) -> float:
        return self.reward_sum / self.samples if self.samples else 0.0


def spec_of(sample: Sample) -> EpisodeSpec:
    return EpisodeSpec(sample_id=sample.id, prompt=sample.prompt, answer=sample.answer, meta=sample.meta)


async def evaluate(
    engine: Engine,
    renderer: Renderer,
    task: Task,
    samples: Sequence[Sample],
    params: SamplingParams,
    limits: EpisodeLimits,
    *,
    concurrency: int = 64,
) -> EvalOutcome:
    """Mean reward of greedy episodes over ``samples`` (accuracy for 0/1 rewards)."""
    greedy = SamplingParams(
        max_new_tokens=params.max_new_tokens, temperature=0.0, top_p=1.0, stop_token_ids=list(params.stop_token_ids)
    )
    gate = asyncio.Semaphore(concurrency)
    out = EvalOutcome()

    async def one(sample: Sample) -> None:
        async with gate:
            ep = await run_episode(
                engine, renderer, task.environment(spec_of(sample)), greedy, limits, sample_id=sample.id
            )
        out.samples += 1
        out.tokens += ep.num_model_tokens
        if ep.status == "ok":
            out.reward_sum += float(ep.reward or 0.0)
        elif ep.status == "infra_error":
            out.infra += 1
        else:
            out.failed += 1

    async with asyncio.TaskGroup() as tg:
        for sample in samples:
            tg.create_task(one(sample))
    return out
