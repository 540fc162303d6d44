"""CPU cost of one trainer step of a recipe, by part: FSDP2 on a one-rank group, a plain module, and a plain module
packing every sample whole (no shared prompts).

    python benchmarks/trainer_step_cost.py --recipe recipes/quickstart.yaml \\
        --out benchmarks/results/trainer_step_cost.json

What the Miles trainer computes per step, measured in isolation (no bus, no rollout workers), so the figures
are CPU seconds of one process (``time.process_time``: every thread of it, gloo's included) and barely move
with the machine's load. A batch of the recipe's shape (``groups_per_step x group_size`` episodes: the
task's train prompts rendered as a worker renders them, completions of up to ``max_new_tokens`` tokens,
random advantages and behaviour log-probs) goes through :class:`miles.training.step.RLStep` on a
:class:`miles.backends.fsdp.FsdpBackend` built from the recipe's prepared model, in three set-ups, each in a
fresh process, interleaved over ``--repeats`` rounds:

* ``fsdp_1rank``: a one-rank gloo group, so the model is ``fully_shard``-ed and every forward / backward
  runs FSDP2's all-gather and reduce-scatter hooks, every metric an ``all_reduce`` (what ``miles run`` did
  for ``trainer.ranks: 1`` until these figures, and still does with bfloat16 parameters);
* ``plain``: the same backend without a process group, what ``build_backend`` now gives one rank with
  float32 parameters;
* ``plain_whole``: ``plain`` with ``trainer.backend.share_prompts=false``: each of a group's samples packed with
  its own copy of the prompt, as before shared prompts.

Per step (medians of ``--steps`` after ``--warmup``): the whole ``RLStep.run`` as it runs (``run``: one
mini-batch, so the proximal log-probs come from the training forward) and with its own no-grad proximal
pass (``run_separate_prox``, ``RLStep.fuse_proximal = False``: the step before that was fused), and on
their own the parts ``pack`` (``RLStep._micro_batches``: episodes to padded tensors) and ``prox``
(``backend.score(..., entropy=True)``: that no-grad forward); ``update`` = run_separate_prox - pack - prox
(forward, backward, optimizer, metric reductions); ``export`` (every parameter through ``export_params``
cast to the rollout dtype, as the streamed export does, without the data plane). Each timed step trains,
so consecutive steps start from different weights; the figures are costs, not losses.

"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

MODES = ("fsdp_1rank", "plain", "plain_whole")


def synth_batch(cfg: Any, tokenizer: Any, task: Any, seed: int) -> list[Any]:
    """Episodes of the recipe's shape: real train prompts, completions of the answer's length class."""
    from miles.backends.base import TrainSample
    from miles.rollout.render import Renderer

    rng = random.Random(seed)
    renderer = Renderer(tokenizer, task.render)
    train = task.samples("train")
    eos = tokenizer.eos_token_id
    max_new = cfg.rollout.sampling.max_new_tokens
    out = []
    for _ in range(cfg.trainer.groups_per_step):
        sample = rng.choice(train)
        prompt = renderer.initial([{"role": "user", "content": sample.prompt}])
        for _ in range(cfg.rollout.group_size):
            answer = list(tokenizer.encode(sample.answer, add_special_tokens=False))
            if rng.random() < 0.5:  # a wrong answer of some length
                answer = list(tokenizer.encode(str(rng.randrange(200)), add_special_tokens=False))
            tokens = (answer + ([eos] if eos is not None else []))[:max_new]
            out.append(
                TrainSample(
                    prompt_ids=prompt,
                    token_ids=tokens,
                    loss_mask=[1] * len(tokens),
                    behaviour_logprobs=[-rng.random() for _ in tokens],
                    advantage=rng.gauss(0.0, 1.0),
                )
            )
    return out


def child(mode: str, recipe: str, overrides: list[str], steps: int, warmup: int, queue: Any) -> None:
    """One set-up in a fresh process: time the parts of ``steps`` RL steps; put the figures on ``queue``."""
    import torch

    from miles.backends.distributed import init_distributed
    from miles.backends.fsdp import FsdpBackend
    from miles.config import load_config
    from miles.models.loading import load_policy, prepared_model_dir
    from miles.ports import free_port
    from miles.tasks.registry import build_task
    from miles.training.step import RLStep

    if mode == "plain_whole":  # every sample packed whole: the recipe without shared prompts
        overrides = [*overrides, "trainer.backend.share_prompts=false"]
    cfg = load_config(recipe, overrides)
    threads = getattr(cfg.trainer.backend, "threads", None)
    if threads is not None:
        torch.set_num_threads(threads)
    if mode == "fsdp_1rank":
        init_distributed(0, 1, "127.0.0.1", free_port(), device=cfg.trainer.backend.device)
    torch.manual_seed(cfg.trainer.seed)
    model, tokenizer = load_policy(prepared_model_dir(cfg.model, cfg.task), "float32", cfg.trainer.backend.device)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0)
    temperature = cfg.rollout.sampling.temperature or 1.0
    backend = FsdpBackend(model, cfg.trainer, 0, 1, temperature=temperature)
    rl = RLStep(backend, cfg.trainer, pad_id=pad, device=cfg.trainer.backend.device)
    task = build_task(cfg.task)
    export_dtype = torch.bfloat16 if cfg.sync.dtype != "float32" else torch.float32

    def timed(fn: Any) -> tuple[float, float, Any]:
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        return time.process_time() - c0, time.perf_counter() - w0, out

    figures: dict[str, list[float]] = {}
    for i in range(warmup + steps):
        samples = synth_batch(cfg, tokenizer, task, seed=i)
        parts: dict[str, tuple[float, float]] = {}
        c, w, mbs = timed(lambda: rl._micro_batches(samples))
        parts["pack"] = (c, w)
        c, w, _ = timed(lambda: backend.score(mbs, entropy=True))
        parts["prox"] = (c, w)
        c, w, _ = timed(lambda: rl.run([samples]))
        parts["run"] = (c, w)
        rl.fuse_proximal = False  # the same step with its own no-grad proximal pass (before it was fused)
        c, w, _ = timed(lambda: rl.run([samples]))
        rl.fuse_proximal = True
        parts["run_separate_prox"] = (c, w)
        c, w, _ = timed(lambda: [t.to(export_dtype) for _, t in backend.export_params()])
        parts["export"] = (c, w)
        if i < warmup:
            continue
        for name, (cpu, wall) in parts.items():
            figures.setdefault(f"{name}_cpu_ms", []).append(1000 * cpu)
            figures.setdefault(f"{name}_wall_ms", []).append(1000 * wall)
        update = parts["run_separate_prox"][0] - parts["pack"][0] - parts["prox"][0]
        figures.setdefault("update_cpu_ms", []).append(1000 * update)
    queue.put(
        {
            "mode": mode,
            "sharded": backend.sharded,
            "samples_per_step": cfg.trainer.groups_per_step * cfg.rollout.group_size,
            "torch_threads": torch.get_num_threads(),
            "median": {k: round(statistics.median(v), 2) for k, v in figures.items()},
        }
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="recipes/quickstart.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from miles.config import load_config
    from miles.prepare import prepare_model

    prepare_model(load_config(args.recipe, args.overrides))  # built once, before anything is timed
    ctx = mp.get_context("spawn")
    runs = []
    load_before = os.getloadavg()[0]
    for repeat in range(args.repeats):
        for mode in MODES if repeat % 2 == 0 else tuple(reversed(MODES)):
            queue = ctx.Queue()
            proc = ctx.Process(target=child, args=(mode, args.recipe, args.overrides, args.steps, args.warmup, queue))
            proc.start()
            result = queue.get()
            proc.join()
            if proc.exitcode != 0:
                print(f"{mode} child exited with {proc.exitcode}", file=sys.stderr)
                return 1
            result["repeat"] = repeat
            runs.append(result)
            print(json.dumps(result), file=sys.stderr, flush=True)
    keys = sorted(runs[0]["median"])
    summary = {
        mode: {k: round(statistics.median(r["median"][k] for r in runs if r["mode"] == mode), 2) for k in keys}
        for mode in MODES
    }
    for a, b in (("plain", "fsdp_1rank"), ("plain", "plain_whole")):
        summary[f"{a}_over_{b}"] = {k: round(summary[a][k] / summary[b][k], 3) for k in keys if summary[b][k]}
    out = {
        "command": "python benchmarks/trainer_step_cost.py " + " ".join(sys.argv[1:]),
        "recipe": args.recipe,
        "overrides": args.overrides,
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "loadavg_1m_before": round(load_before, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
        "summary": summary,
        "runs": runs,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
