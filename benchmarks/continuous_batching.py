"""Continuous against fixed batching in the torch engine, on the long-tailed ``copy`` task with the tiny model.

    python benchmarks/continuous_batching.py --out benchmarks/results/continuous_batching.json

Both modes run the same :class:`~miles.engines.torch_engine.TorchEngine` on the same requests: the first
``--requests`` prompts of the copy task's train split (``CopyTaskConfig()``: string lengths log-normal, so most
completions are a few tokens and a few are up to 57), sampled at temperature 1 with ``max_new_tokens`` 57 and
the tokenizer's stop ids, as rollouts are.

* **continuous**: every request is submitted at once; the engine keeps up to ``--batch`` rows running and a
  queued request takes the place of a finished one at the next token boundary.
* **fixed**: a driver submits ``--batch`` requests, waits for all of them (the batch waits for its longest),
  then the next ``--batch``. Finished rows still leave the running batch, so a fixed step gets cheaper as its
  batch drains; what fixed batching loses is the slots left idle until the longest request is done.

Each run gets a fresh engine with the same seed, and requests are submitted in the same order, so each
request has the same random stream in both modes and both modes sample exactly the same tokens (checked:
``same_outputs``); only the schedule differs. Runs are interleaved (continuous, fixed, then fixed,
continuous, ...) for ``--repeats`` rounds so that a change in machine load hits both modes alike. Reported
per run: output tokens, wall seconds, tokens/s, model forwards and mean rows per decode forward; per round the
ratio continuous / fixed tokens/s, and the median, min and max ratio over rounds.

The tiny model is built (or found in the cache) before anything is timed. One torch thread, as rollout
workers run (``rollout.engine.threads``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from miles.config import CopyTaskConfig, RunConfig, TinyModelConfig, TorchEngineConfig
from miles.engines.base import Generation, SamplingParams
from miles.engines.batch import generate_all
from miles.engines.torch_engine import TorchEngine
from miles.models.loading import encode_prompt, load_policy, stop_token_ids
from miles.prepare import prepare_model
from miles.tasks.registry import build_task

MAX_NEW_TOKENS = 57  # CopyTaskConfig().max_len + 1 (the answer, then EOS)


class ForwardCounter:
    """Counts the model's forwards and the rows of its decode forwards (one new token per row), on the input
    embedding, which every forward (HF's or the engine's lean one) calls once with the input ids."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.forwards = 0
        self.decode_forwards = 0
        self.decode_rows = 0
        self._handle = model.get_input_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        rows, tokens = args[0].shape
        self.forwards += 1
        if tokens == 1:
            self.decode_forwards += 1
            self.decode_rows += rows

    def remove(self) -> None:
        self._handle.remove()


async def run_mode(
    mode: str, model: Any, pad: int, prompts: list[list[int]], params: SamplingParams, batch: int, seed: int
) -> tuple[dict[str, Any], list[list[int]]]:
    """One timed run of ``mode`` on a fresh engine; returns its figures and the output ids per request."""
    engine = TorchEngine(model, pad, cfg=TorchEngineConfig(max_batch=batch), version=0, seed=seed)
    counter = ForwardCounter(model)
    gens: list[Generation] = []
    try:
        async with engine:
            start = time.perf_counter()
            if mode == "continuous":
                gens = await generate_all(engine, prompts, params)
            else:
                for first in range(0, len(prompts), batch):
                    gens += await generate_all(engine, prompts[first : first + batch], params)
            seconds = time.perf_counter() - start
    finally:
        counter.remove()
    tokens = sum(len(g.output_ids) for g in gens)
    figures = {
        "mode": mode,
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 1),
        "forwards": counter.forwards,
        "rows_per_decode_forward": round(counter.decode_rows / max(1, counter.decode_forwards), 2),
    }
    return figures, [g.output_ids for g in gens]


def bench_config() -> RunConfig:
    return RunConfig(task=CopyTaskConfig(), model=TinyModelConfig())


async def benchmark(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    cfg = bench_config()
    task_cfg = cfg.task
    model, tokenizer = load_policy(model_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    task = build_task(task_cfg)
    samples = task.samples("train")[: args.requests]
    prompts = [encode_prompt(tokenizer, s.prompt) for s in samples]
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, stop_token_ids=stop_token_ids(tokenizer))
    answer_lengths = sorted(len(s.answer) + 1 for s in samples)  # + EOS: the completion a perfect model writes

    # Warm-up (allocator, kernels), untimed.
    await run_mode("continuous", model, pad, prompts[: args.batch], params, args.batch, seed=0)
    runs: list[dict[str, Any]] = []
    ratios: list[float] = []
    same_outputs = True
    for repeat in range(args.repeats):
        order = ("continuous", "fixed") if repeat % 2 == 0 else ("fixed", "continuous")
        by_mode: dict[str, dict[str, Any]] = {}
        outputs: dict[str, list[list[int]]] = {}
        for mode in order:
            figures, outputs[mode] = await run_mode(mode, model, pad, prompts, params, args.batch, seed=repeat + 1)
            by_mode[mode] = figures | {"repeat": repeat}
            runs.append(by_mode[mode])
            print(json.dumps(by_mode[mode]), file=sys.stderr)
        same_outputs &= outputs["continuous"] == outputs["fixed"]
        ratios.append(by_mode["continuous"]["tokens_per_s"] / by_mode["fixed"]["tokens_per_s"])

    def median(mode: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs if r["mode"] == mode), 2)

    return {
        "command": " ".join(["python", "benchmarks/continuous_batching.py", *sys.argv[1:]]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
            "note": "shared machine: other jobs ran alongside; compare ratios within a round, not across runs",
        },
        "setup": {
            "model": cfg.model.model_dump(mode="json", exclude={"cache_dir"}),
            "task": task_cfg.model_dump(mode="json"),
            "requests": len(prompts),
            "batch": args.batch,
            "max_new_tokens": MAX_NEW_TOKENS,
            "temperature": params.temperature,
            "answer_tokens_median": answer_lengths[len(answer_lengths) // 2],
            "answer_tokens_p99": answer_lengths[int(0.99 * (len(answer_lengths) - 1))],
            "answer_tokens_max": answer_lengths[-1],
        },
        "runs": runs,
        "summary": {
            "continuous_tokens_per_s_median": median("continuous", "tokens_per_s"),
            "fixed_tokens_per_s_median": median("fixed", "tokens_per_s"),
            "continuous_forwards_median": median("continuous", "forwards"),
            "fixed_forwards_median": median("fixed", "forwards"),
            "continuous_rows_per_decode_forward_median": median("continuous", "rows_per_decode_forward"),
            "fixed_rows_per_decode_forward_median": median("fixed", "rows_per_decode_forward"),
            "ratio_median": round(statistics.median(ratios), 3),
            "ratio_min": round(min(ratios), 3),
            "ratio_max": round(max(ratios), 3),
            "same_outputs": same_outputs,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256, help="prompts from the copy task's train split")
    parser.add_argument("--batch", type=int, default=32, help="rows in the running batch / size of a fixed batch")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (one run of each mode per round)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here (it is printed either way)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # Built (or found in the cache) before the event loop starts: the warm-up runs its own loop.
    model_dir = prepare_model(bench_config())
    result = asyncio.run(benchmark(args, model_dir))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
