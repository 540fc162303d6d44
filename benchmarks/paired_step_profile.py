"""CPU per step of two trees (or two configs) of Miles, run by run: ``step_profile.py`` runs interleaved A B A B.

    git worktree add /tmp/base <older commit>
    python benchmarks/paired_step_profile.py --pairs 3 --steps 200 \\
        --side base=/tmp/base --side new=. --out benchmarks/results/paired_step_profile.json

Each ``--side NAME=DIR[:KEY=VALUE,...]`` is a checkout (its ``benchmarks/step_profile.py`` runs with the checkout as
the working directory, so ``python -m miles.cli`` imports that tree's ``miles``) and optional config overrides.
The first side is the baseline. Every pair runs each side once, one after the other, in turn; on a shared
machine whose speed drifts within the hour, the ratio of two runs minutes apart is the figure to trust, and the
headline is each ratio's median over the pairs. Per run: the CPU seconds of every process per step over the
training window and the cadence (seconds between step records), as ``step_profile.py`` measures them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def parse_side(text: str) -> tuple[str, Path, list[str]]:
    """``NAME=DIR[:KEY=VALUE,...]`` -> (name, checkout, overrides)."""
    name, _, rest = text.partition("=")
    where, _, sets = rest.partition(":")
    if not name or not where:
        raise argparse.ArgumentTypeError(f"--side {text!r}: expected NAME=DIR[:KEY=VALUE,...]")
    return name, Path(where).resolve(), [s for s in sets.split(",") if s]


def profile(checkout: Path, recipe: str, steps: int, overrides: list[str], out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "benchmarks/step_profile.py", "--recipe", recipe, "--set", f"trainer.steps={steps}"]
    for override in overrides:
        cmd += ["--set", override]
    cmd += ["--no-py-spy", "--out", str(out)]
    subprocess.run(cmd, cwd=checkout, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    run = json.loads(out.read_text())
    return {
        "cadence_s": run["cadence_s_median"],
        "cpu_s_per_step": run["cpu_s_in_window_total"] / run["steps"],
        "cpu_s_per_step_by_process": run["cpu_s_per_step"],
        "eval_after": run["eval_after"],
        "loadavg_1m_before": run["loadavg_1m_before"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", action="append", type=parse_side, required=True, help="NAME=DIR[:KEY=VALUE,...]")
    p.add_argument("--recipe", default="recipes/quickstart.yaml")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()
    if len(args.side) < 2:
        p.error("give at least two --side (the first is the baseline)")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in args.side}
    with tempfile.TemporaryDirectory(prefix="miles-paired-") as tmp:
        for index in range(args.pairs):
            for name, checkout, overrides in args.side:
                run = profile(checkout, args.recipe, args.steps, overrides, Path(tmp) / f"{name}-{index}.json")
                runs[name].append(run)
                print(json.dumps({"pair": index, "side": name, **run}), file=sys.stderr, flush=True)
    base = args.side[0][0]
    ratios = {
        name: {
            key: statistics.median(r[key] / b[key] for r, b in zip(runs[name], runs[base], strict=True))
            for key in ("cpu_s_per_step", "cadence_s")
        }
        for name, _, _ in args.side[1:]
    }
    result = {
        "command": "python benchmarks/paired_step_profile.py " + " ".join(sys.argv[1:]),
        "recipe": args.recipe,
        "steps": args.steps,
        "sides": {name: {"checkout": str(checkout), "overrides": overrides} for name, checkout, overrides in args.side},
        "runs": runs,
        "median_ratio_to_" + base: ratios,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
