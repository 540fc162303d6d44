"""Time per step of the quickstart with sharded checkpoints every 1, 10 and 100 steps, side by side.

    python benchmarks/checkpoint_interval.py --steps 200 --out benchmarks/results/checkpoint_interval.json

Each configuration is a full `miles run` of recipes/quickstart.yaml (embedded NATS, controller, two rollout
workers, one trainer rank) for ``--steps`` steps; the runs are interleaved over ``--repeats`` rounds so that
the machine's load drifts over all of them alike. Reported per run: the median and mean `step_s` over the
training window (the first 5 steps excluded: start-up), the process wall time, and each interval's ratio to
the 100-step one. Checkpoints are asynchronous (`trainer.async_checkpoint`, the default) unless
``--sync`` is given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "quickstart.yaml"


def run_once(every: int, steps: int, work: Path, model_cache: str | None, synchronous: bool) -> dict[str, Any]:
    run_dir = work / f"every{every}-{time.time_ns()}"
    sets = [f"trainer.steps={steps}", f"trainer.checkpoint_every={every}", "eval.every=0", "monitor.plots=false"]
    if synchronous:
        sets.append("trainer.async_checkpoint=false")
    if model_cache:
        sets.append(f"model.cache_dir={model_cache}")
    cmd = [sys.executable, "-m", "miles.cli", "run", str(RECIPE), "--run-dir", str(run_dir), "--quiet"]
    for item in sets:
        cmd += ["--set", item]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"run failed (checkpoint_every={every}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = [r["step_s"] for r in rows[5:] if r.get("step_s") is not None]
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    return {
        "checkpoint_every": every,
        "steps": len(rows),
        "step_s_median": statistics.median(step_s),
        "step_s_mean": statistics.fmean(step_s),
        "process_wall_s": round(wall, 2),
        "checkpoints_kept": checkpoints,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--intervals", default="1,10,100")
    parser.add_argument("--work", default="runs/bench-checkpoint")
    parser.add_argument("--model-cache", default=None)
    parser.add_argument("--sync", action="store_true", help="synchronous checkpoints")
    parser.add_argument("--out", default="benchmarks/results/checkpoint_interval.json")
    args = parser.parse_args()
    intervals = [int(x) for x in args.intervals.split(",")]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    for round_ in range(args.repeats):
        order = intervals if round_ % 2 == 0 else list(reversed(intervals))
        for every in order:
            result = run_once(every, args.steps, work, args.model_cache, args.sync)
            result["round"] = round_
            runs.append(result)
            print(json.dumps(result), flush=True)
    summary: dict[str, Any] = {}
    for every in intervals:
        mine = [r["step_s_median"] for r in runs if r["checkpoint_every"] == every]
        summary[str(every)] = {"step_s_median": statistics.median(mine), "runs": len(mine)}
    base = summary[str(max(intervals))]["step_s_median"]
    for every in intervals:
        summary[str(every)]["x_every_" + str(max(intervals))] = round(summary[str(every)]["step_s_median"] / base, 3)
    out = {"command": " ".join(sys.argv), "synchronous": args.sync, "summary": summary, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
