"""Every RL algorithm of the algorithm layer on the quickstart, same budget, side by side.

    python benchmarks/algorithms.py --out benchmarks/results/algorithms.json

Quick check (every row, 5 steps each):

    python benchmarks/algorithms.py --steps 5 --out /tmp/algos.json

A few rows, with an extra override on each (CISPO's rows, issue 12):

    python benchmarks/algorithms.py --only cispo cispo_paper --set trainer.lr=2.5e-4 --runs runs/bench-cispo

Runs ``miles run recipes/quickstart.yaml --set trainer.steps=<steps> --set ...`` once per row, one at a time
(never concurrently), same seed, same prompts, same budget (``steps x groups_per_step x group_size``
trained samples; DAPO's filtered groups are extra generation, not extra training). Each row changes only
the ``trainer.algo`` keys it names (docs/algorithms.md); rows other than the first take several optimizer
steps per rollout batch (``minibatches``), so that the ratio and its clip act. From each run's record:
held-out greedy accuracy before and after (200 problems, from ``evals.jsonl``; binomial standard error printed), mean
``clip_frac`` over the steps, the mean completion length of the last 20 steps, groups filtered, wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RECIPE = "recipes/quickstart.yaml"
MB = ["trainer.algo.minibatches=4"]

ROWS: dict[str, tuple[str, list[str]]] = {
    "grpo": ("GRPO, one optimizer step per batch (the quickstart)", []),
    "grpo_mb4": ("GRPO, 4 mini-batches, clip-higher 0.2/0.28", MB),
    "grpo_mb4_sym": ("GRPO, 4 mini-batches, symmetric clip 0.2/0.2", [*MB, "trainer.algo.loss.clip_high=0.2"]),
    "dr_grpo": (
        "Dr. GRPO (no std, constant normaliser)",
        [*MB, "trainer.algo.advantage=grpo_no_std", "trainer.algo.loss.aggregation=constant"],
    ),
    "dapo": (
        "DAPO (clip-higher, token mean, dynamic sampling, overlong shaping)",
        [
            *MB,
            "trainer.algo.filter.type=reward_variance",
            "trainer.algo.filter.over_issue=0.5",
            "trainer.algo.reward_shaping.type=overlong",
            "trainer.algo.reward_shaping.buffer_tokens=1",
        ],
    ),
    "gspo": ("GSPO (sequence ratio, clip 3e-4/4e-4)", [*MB, "trainer.algo.loss=gspo"]),
    "reinforce_pp": ("REINFORCE++ (batch whitening, no baseline)", [*MB, "trainer.algo.advantage=reinforce_pp"]),
    "reinforce_pp_baseline": (
        "REINFORCE++-baseline (group mean, batch whitening)",
        [*MB, "trainer.algo.advantage=reinforce_pp_baseline"],
    ),
    "cispo": ("CISPO (IS weight <= 5, lower trust-region mask 0.2: the defaults)", [*MB, "trainer.algo.loss=cispo"]),
    "cispo_paper": (
        "CISPO, the paper's form (no mask)",
        [*MB, "trainer.algo.loss=cispo", "trainer.algo.loss.mask_low=null"],
    ),
    "cispo_paper_lr": (
        "CISPO, the paper's form, half the learning rate (2.5e-4)",
        [*MB, "trainer.algo.loss=cispo", "trainer.algo.loss.mask_low=null", "trainer.lr=2.5e-4"],
    ),
}


def _run(name: str, sets: list[str], steps: int, out_dir: Path) -> dict[str, Any]:
    run_dir = out_dir / name
    cmd = [sys.executable, "-m", "miles.cli", "run", RECIPE, "--run-dir", str(run_dir), "--quiet"]
    for item in [f"trainer.steps={steps}", f"eval.every={max(1, steps // 3)}", *sets]:
        cmd += ["--set", item]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{name}: miles run exited {proc.returncode}\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = metrics[-20:]
    # The final evaluation from the run's own log: summary.json has been seen naming the one before it.
    evals = {e["step"]: e["eval_accuracy"] for e in map(json.loads, (run_dir / "evals.jsonl").read_text().splitlines())}
    if steps not in evals:
        raise SystemExit(f"{name}: no evaluation at step {steps} in {run_dir / 'evals.jsonl'}")
    before, after = evals[0], evals[steps]
    return {
        "name": name,
        "command": " ".join(cmd[2:]),
        "eval_before": before,
        "eval_after": after,
        "gain": after - before,
        "se_after": math.sqrt(after * (1 - after) / 200),
        "clip_frac_mean": sum(m.get("clip_frac", 0.0) for m in metrics) / len(metrics),
        "length_mean_last20": sum(m["length_mean"] for m in last) / len(last),
        "groups_filtered": summary.get("discard_reasons", {}).get("filtered", 0),
        "samples_trained": summary["samples_trained"],
        "wall_s": round(wall, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="Rollout batches per run (same for every row).")
    parser.add_argument("--only", nargs="*", default=None, help="Rows to run (default: all).")
    parser.add_argument("--runs", default="runs/bench-algorithms", help="Where the run directories go.")
    parser.add_argument("--out", default=None, help="Write the rows as JSON here.")
    parser.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="An extra override applied to every row run, after the row's own (repeatable), e.g. to try a "
        "row at another learning rate: --only cispo --set trainer.lr=2e-4.",
    )
    args = parser.parse_args()
    names = args.only or list(ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    out_dir = Path(args.runs)
    rows = []
    for name in names:
        label, sets = ROWS[name]
        row = _run(name, [*sets, *args.extra], args.steps, out_dir) | {"label": label}
        rows.append(row)
        print(f"{name}: {row['eval_before']:.3f} -> {row['eval_after']:.3f} ({row['wall_s']} s)", file=sys.stderr)
    extra = f"; every row with --set {' --set '.join(args.extra)}" if args.extra else ""
    print(f"\nquickstart, {args.steps} steps x 32 groups x 8 samples; eval: 200 held-out problems, greedy{extra}\n")
    print("| algorithm | eval before -> after | gain | SE | clip_frac (mean) | length (last 20) | filtered | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['label']} | {r['eval_before']:.3f} -> {r['eval_after']:.3f} | {r['gain']:+.3f} | "
            f"{r['se_after']:.3f} | {r['clip_frac_mean']:.4f} | {r['length_mean_last20']:.2f} | "
            f"{r['groups_filtered']} | {r['wall_s']} |"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        record = {"steps": args.steps, "extra_sets": args.extra, "rows": rows}
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
