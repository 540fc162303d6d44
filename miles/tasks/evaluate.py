"""Held-out evaluation: greedy accuracy of an engine's policy on a list of samples."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles.engines.base import Engine, SamplingParams
from miles.models.loading import encode_prompt, stop_token_ids
from miles.tasks.base import Sample, Task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

EVAL_BATCH_SIZE = 256


def evaluate(
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    samples: list[Sample],
    max_new_tokens: int,
    batch_size: int = EVAL_BATCH_SIZE,
) -> float:
    """Mean reward of greedy completions (= accuracy for 0/1 rewards); 0.0 for no samples.

    Greedy so that the number is a property of the weights, not of sampling luck; batched in
    chunks of ``batch_size`` prompts to bound the engine's memory.
    """
    if not samples:
        return 0.0
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stop_token_ids(tokenizer))
    total = 0.0
    for start in range(0, len(samples), batch_size):
        chunk = samples[start : start + batch_size]
        generations = engine.generate([encode_prompt(tokenizer, s.prompt) for s in chunk], params)
        for sample, gen in zip(chunk, generations, strict=True):
            text = tokenizer.decode(gen.output_ids, skip_special_tokens=True)
            total += task.reward(text, sample)
    return total / len(samples)
