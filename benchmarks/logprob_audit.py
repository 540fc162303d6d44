"""The log-prob audit: the honest engine-vs-trainer gap against forged log-probs, and its cost per step.

    python benchmarks/logprob_audit.py --out benchmarks/results/logprob_audit.json

On the quickstart's recipe (its prepared tiny model, arithmetic prompts, 32 groups of 8 sampled at temperature 1
by the embedded torch engine, as a rollout worker does):

* **Gaps**: per trajectory, the mean ``|log pi - log mu|`` per token that the trainer's forward
  (:meth:`miles.training.step.RLStep.logprob_gaps` under a :class:`~miles.training.snapshots.VersionSnapshots`
  copy, what ``trainer.audit.logprob_rate`` runs) finds between its log-probs and the behaviour log-probs
  reported by an engine holding the weights as workers do (sent in the recipe's ``sync.dtype``): the engine's
  own (honest; scored with copies in that precision, as Miles does, and with the trainer's float32 weights,
  as for FP8/FP4 or LoRA sync), and three forgeries a dishonest
  worker could send on the same tokens: a constant per token, the log-probs of another model (a worker that
  generated with a cheaper model, here the checkpoint before its warm-up), and the engine's own plus noise.
  Against ``trainer.audit.logprob_tolerance`` (default 0.05): the share of each kind the audit refuses.
* **Cost**: the trainer's step (:meth:`RLStep.run` on the batch) and the audit at rate 1 (copy the version,
  put it in, score the whole batch, put the live weights back), timed interleaved in one process, as CPU time;
  the forward at rate r costs r of it.

Detection against the rate is that of the reward audit (benchmarks/reward_audit.py) over the trajectories that
have tokens of the trainer's current version (their share in a real run: the command below the table in
benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from miles.backends.base import TrainSample
from miles.backends.fsdp import FsdpBackend
from miles.config import load_config
from miles.engines.base import SamplingParams
from miles.engines.batch import generate_all
from miles.engines.torch_engine import TorchEngine
from miles.models.loading import encode_prompt, load_policy, stop_token_ids
from miles.prepare import prepare_model
from miles.tasks.registry import build_task
from miles.training.packing import pack_micro_batches
from miles.training.snapshots import VersionSnapshots
from miles.training.step import RLStep, plan_batch

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"


async def _sample(model_dir: Path, prompts: list[list[int]], params: SamplingParams, sync_dtype: str) -> list[Any]:
    """The engine's generations, its weights as a worker holds them: sent in ``sync_dtype`` (the recipe's
    ``sync.dtype``), while the trainer keeps float32 masters."""
    model, tokenizer = load_policy(model_dir)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(getattr(torch, sync_dtype)).float())
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    async with TorchEngine(model, pad, version=0, seed=0) as engine:
        return await generate_all(engine, prompts, params)


def _gaps(step: RLStep, samples: list[TrainSample]) -> list[float]:
    """Mean |log pi - log mu| per token of each sample, by the audit's own forward."""
    sums = step.logprob_gaps(list(enumerate(samples)), len(samples))
    return [sums[2 * i] / max(sums[2 * i + 1], 1.0) for i in range(len(samples))]


def _per_group(values: list[float], group_size: int) -> list[float]:
    """A trajectory's gap: the mean over its episodes (all have about as many tokens here)."""
    return [statistics.fmean(values[i : i + group_size]) for i in range(0, len(values), group_size)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20, help="Interleaved (step, audit) pairs timed for the cost.")
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)  # the quickstart trainer's share of two cores
    cfg = load_config(RECIPE)
    model_dir = prepare_model(cfg)
    task = build_task(cfg.task)
    _, tokenizer = load_policy(model_dir)
    group_size, groups = cfg.rollout.group_size, cfg.trainer.groups_per_step
    samples = task.samples("train")[:groups]
    prompts = [encode_prompt(tokenizer, s.prompt) for s in samples for _ in range(group_size)]
    sampling = cfg.rollout.sampling
    stops = stop_token_ids(tokenizer)
    params = SamplingParams(
        max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature, stop_token_ids=stops
    )
    advantages = [(-1.0) ** i * 0.5 for i in range(len(prompts))]

    gens = asyncio.run(_sample(model_dir, prompts, params, cfg.sync.dtype))  # as a worker holds the weights
    honest = [
        TrainSample(prompt, list(g.output_ids), [1] * len(g.output_ids), list(g.logprobs), advantage=adv)
        for prompt, g, adv in zip(prompts, gens, advantages, strict=True)
    ]

    policy, _ = load_policy(model_dir)
    backend = FsdpBackend(policy, cfg.trainer, temperature=sampling.temperature)
    step = RLStep(backend, cfg.trainer, pad_id=0)
    rollout_dtype = getattr(torch, cfg.sync.dtype)
    snapshots = VersionSnapshots(backend, keep=1, dtype=rollout_dtype)  # as the trainer ranks keep them
    snapshots.take(0)
    # Another model's log-probs of the same tokens: the tiny model's random init, before its warm-up.
    torch.manual_seed(0)
    other = FsdpBackend(type(policy)(policy.config), cfg.trainer, temperature=sampling.temperature)
    other_logps = _model_logps(other, honest)
    rng = random.Random(0)
    arms = {
        f"honest; audit copies in {cfg.sync.dtype}, as workers hold them (miles)": (honest, True),
        "honest; audit with the trainer's float32 weights (FP8/FP4 or LoRA sync)": (honest, False),
        "constant -0.5 per token": ([replace(s, behaviour_logprobs=[-0.5] * len(s.token_ids)) for s in honest], True),
        "another model's": (
            [replace(s, behaviour_logprobs=lp) for s, lp in zip(honest, other_logps, strict=True)],
            True,
        ),
        "the engine's + N(0, 0.1)": (
            [
                replace(s, behaviour_logprobs=[min(0.0, x + rng.gauss(0, 0.1)) for x in s.behaviour_logprobs])
                for s in honest
            ],
            True,
        ),
    }
    rows = []
    for kind, (batch, in_rollout_precision) in arms.items():
        with snapshots.weights_of(0) if in_rollout_precision else contextlib.nullcontext():
            per_traj = _per_group(_gaps(step, batch), group_size)
        rows.append(
            {
                "behaviour_logprobs": kind,
                "gap_median": statistics.median(per_traj),
                "gap_max": max(per_traj),
                "gap_min": min(per_traj),
                "refused_at_tolerance": sum(g > args.tolerance for g in per_traj) / len(per_traj),
            }
        )

    plan = plan_batch(honest, cfg.trainer.algo.minibatches, 1)[0]
    indexed = list(enumerate(honest))
    step_s, audit_s = [], []
    for _ in range(args.repeats):  # the audit at rate 1: keep the version, score the whole batch under it
        t0 = time.process_time()
        step.run(plan)
        t1 = time.process_time()
        snapshots.take(0)
        with snapshots.weights_of(0):
            step.logprob_gaps(indexed, len(honest))
        t2 = time.process_time()
        step_s.append(t1 - t0)
        audit_s.append(t2 - t1)
    s, a = statistics.median(step_s), statistics.median(audit_s)
    cost = {
        "trajectories_per_step": groups,
        "episodes_per_step": len(honest),
        "tokens_per_step": sum(len(x.token_ids) for x in honest),
        "step_ms": round(1e3 * s, 1),
        "audit_ms_at_rate_1": round(1e3 * a, 1),
        "audit_over_step_at_rate_1": round(a / s, 3),
    }
    print("| behaviour log-probs | gap per token, median | min | max | refused at tolerance |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['behaviour_logprobs']} | {r['gap_median']:.3g} | {r['gap_min']:.3g} | {r['gap_max']:.3g} "
            f"| {r['refused_at_tolerance']:.2f} |"
        )
    print(json.dumps(cost))
    if args.out:
        args.out.write_text(json.dumps({"tolerance": args.tolerance, "gaps": rows, "cost": cost}, indent=1) + "\n")


def _model_logps(backend: FsdpBackend, samples: list[TrainSample]) -> list[list[float]]:
    """The log-probs ``backend``'s model gives each sample's tokens (to forge with)."""
    (mb,) = pack_micro_batches(samples, pad_id=0)
    (out,) = backend.score([mb])
    cut = mb.per_sample(out.logp)
    return [list(cut[i]) for i in range(len(samples))]


if __name__ == "__main__":
    main()
