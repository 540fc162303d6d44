"""Self-distillation that shortens rollouts: both phases, plus the same student budget without the teacher.

    python benchmarks/selfdistill.py --out benchmarks/results/selfdistill.json

Runs, one after the other (never concurrently):

1. ``miles run recipes/selfdistill-teacher.yaml``: phase 1, RL under a tight length cap (5 tokens; a truncated
   answer scores 0), from the warmed-up verbose model;
2. ``miles run recipes/selfdistill-student.yaml`` with ``trainer.algo.distill.teacher.path`` = phase 1's run
   directory: phase 2, the *original* warmed-up model trained on its own samples (cap 32) with the per-token
   distillation term ``A_t - 0.2 * (logp_student - logp_teacher)`` beside the task reward;
3. control: the phase-2 recipe with ``trainer.algo.distill`` removed (``--set trainer.algo.distill=null``),
   i.e. GRPO on the same model, cap and budget, with no teacher.

From each run's record: held-out greedy accuracy (200 problems, binomial standard error) and mean completion
length (``evals.jsonl``, capped at ``eval.max_new_tokens`` = 32) before and after; the mean training
completion length of the first and last 20 steps; the last 20 steps' mean reverse KL to the teacher.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _run(recipe: str, run_dir: Path, sets: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "miles.cli", "run", recipe, "--run-dir", str(run_dir), "--quiet"]
    for item in sets:
        cmd += ["--set", item]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{recipe}: miles run exited {proc.returncode}\n{proc.stderr[-3000:]}")
    evals = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, last = evals[0], evals[-1]
    acc = last["eval_accuracy"]

    def mean(rows: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in rows if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    return {
        "command": " ".join(["miles", *cmd[3:]]),
        "steps": len(metrics),
        "eval_accuracy_before": first["eval_accuracy"],
        "eval_accuracy_after": acc,
        "eval_se_after": math.sqrt(acc * (1 - acc) / last["samples"]),
        "eval_length_before": first["length_mean"],
        "eval_length_after": last["length_mean"],
        "train_length_first20": mean(metrics[:20], "length_mean"),
        "train_length_last20": mean(metrics[-20:], "length_mean"),
        "reward_last20": mean(metrics[-20:], "reward_mean"),
        "reverse_kl_first20": mean(metrics[:20], "distill_reverse_kl"),
        "reverse_kl_last20": mean(metrics[-20:], "distill_reverse_kl"),
        "evals": [(e["step"], e["eval_accuracy"], e["length_mean"]) for e in evals],
        "wall_s": round(time.perf_counter() - started, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="runs/bench-selfdistill", help="Where the run directories go.")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="Override for all three runs.")
    parser.add_argument("--skip-control", action="store_true", help="Only the two phases.")
    parser.add_argument("--out", default=None, help="Write the results as JSON here.")
    args = parser.parse_args()
    root = Path(args.runs)
    teacher_dir = root / "teacher"
    results = {"teacher": _run("recipes/selfdistill-teacher.yaml", teacher_dir, args.sets)}
    print(f"teacher: {results['teacher']['evals']}", file=sys.stderr)
    teacher_path = f"trainer.algo.distill.teacher.path={teacher_dir}"
    results["student"] = _run("recipes/selfdistill-student.yaml", root / "student", [*args.sets, teacher_path])
    print(f"student: {results['student']['evals']}", file=sys.stderr)
    if not args.skip_control:
        control = [*args.sets, "trainer.algo.distill=null"]
        results["control"] = _run("recipes/selfdistill-student.yaml", root / "control", control)
        print(f"control: {results['control']['evals']}", file=sys.stderr)

    print("\n| run | held-out accuracy before -> after (SE) | held-out length before -> after | "
          "train length first 20 -> last 20 steps | reverse KL first 20 -> last 20 |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, r in results.items():
        kl = (
            f"{r['reverse_kl_first20']:.3f} -> {r['reverse_kl_last20']:.3f}"
            if r["reverse_kl_last20"] is not None
            else "-"
        )
        print(
            f"| {name} | {r['eval_accuracy_before']:.3f} -> {r['eval_accuracy_after']:.3f} "
            f"({r['eval_se_after']:.3f}) | "
            f"{r['eval_length_before']:.2f} -> {r['eval_length_after']:.2f} | "
            f"{r['train_length_first20']:.2f} -> {r['train_length_last20']:.2f} | {kl} |"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
