"""Evaluations that make rollouts stale: one worker, evaluations every few steps, eval.hold_rollouts off and on.

    python benchmarks/eval_staleness.py --out benchmarks/results/eval_staleness.json

Quick check (tiny model, a few steps): ``--recipe recipes/quickstart.yaml --steps 20 --set rollout.workers=1``.

An evaluation pins a rollout worker's weights (one version for the whole shard). With one worker, the groups
it starts meanwhile come from those weights while the trainer moves on, so they reach it past the staleness
bound and are issued again: generation thrown away. ``eval.hold_rollouts`` (the default) holds new groups
while the pinned weights are that far behind. Both arms run the same recipe, seed and steps one after the
other (never concurrently, so neither steals the other's cores), and the script reports, from each run's
summary.json: groups issued, re-issued as stale (and their share), wall time, held-out accuracy before and
after, and the size of the newest checkpoint.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_arm(
    recipe: str, run_dir: Path, hold: bool, steps: int, every: int, seed: int, extra: list[str]
) -> dict[str, Any]:
    sets = [f"trainer.steps={steps}", f"eval.every={every}", f"eval.hold_rollouts={str(hold).lower()}", f"seed={seed}"]
    cmd = [sys.executable, "-m", "miles.cli", "run", recipe, "--run-dir", str(run_dir), "--quiet"]
    for item in [*sets, *extra]:
        cmd += ["--set", item]
    print(f"[eval_staleness] {' '.join(cmd)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    issued, requeued = summary["groups_issued"], summary["trajectories_requeued"]
    return {
        "hold_rollouts": hold,
        "groups_issued": issued,
        "groups_reissued_stale": requeued,
        "reissued_share": round(requeued / issued, 4) if issued else None,
        "wall_s": summary["wall_s"],
        "eval_before": summary["eval_before"],
        "eval_after": summary["eval_after"],
        "staleness_mean": summary["staleness_mean"],
        "checkpoint_bytes": _dir_bytes(checkpoints[-1]) if checkpoints else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/smollm2-135m.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5, help="eval.every")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], help="more recipe overrides, key=value")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    arms = []
    with tempfile.TemporaryDirectory(prefix="eval_staleness-") as tmp:
        for hold in (False, True):
            arms.append(
                run_arm(args.recipe, Path(tmp) / f"hold-{hold}", hold, args.steps, args.every, args.seed, args.set)
            )
    report = {
        "command": " ".join(sys.argv),
        "recipe": args.recipe,
        "steps": args.steps,
        "eval_every": args.every,
        "seed": args.seed,
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "arms": arms,
    }
    print("| eval.hold_rollouts | groups issued | re-issued as stale | share | wall s | eval before -> after |")
    print("|---|---|---|---|---|---|")
    for a in arms:
        print(
            f"| {str(a['hold_rollouts']).lower()} | {a['groups_issued']} | {a['groups_reissued_stale']} | "
            f"{a['reissued_share']:.1%} | {a['wall_s']:.0f} | {a['eval_before']:.2f} -> {a['eval_after']:.2f} |"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
