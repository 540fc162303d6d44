"""Time per step of the quickstart with sharded checkpoints every 1, 10 and 100 steps, side by side.

    python benchmarks/checkpoint_interval.py --steps 200 --repeats 2 --out benchmarks/results/checkpoint_interval.json

Each configuration is a full `miles run` of recipes/quickstart.yaml (embedded NATS, controller, two rollout
workers, one trainer rank) for ``--steps`` steps, evaluations only before and after (``eval.every=0``); the
runs are interleaved over ``--repeats`` rounds (1, 10, 100, then 100, 10, 1, ...) so that the machine's load
drifts over all of them alike. Checkpoints are asynchronous (``trainer.async_checkpoint``, the default)
unless ``--sync`` is given.

Time per step is measured two ways, over the training window (the first ``--skip`` steps excluded: start-up
and the first evaluation):

* ``cadence``: the interval between consecutive steps' records in ``metrics.jsonl`` (the controller's receipt
  time, ``time``). It covers everything the trainer does per step, the checkpoint included, so it is the
  headline figure.
* ``step_s``: what the trainer reports. It runs from the end of one step's ``_step`` call to the next step's
  weight publish, so it does *not* contain the step's own acks, step report and checkpoint save (they happen
  after the publish, before the next window starts): a synchronous checkpoint is invisible in it, an
  asynchronous one shows up only as the CPU its writer takes from the next step.

Per run also: process wall time, CPU seconds of the whole process tree, checkpoint save seconds (from the
trainer's ``checkpoint.complete`` log lines: the time from the save call to the checkpoint being durable,
which for async saves overlaps training) and the 1-minute load average before and after. The summary gives,
per interval, the median over runs of each figure and its ratio to the largest interval.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "quickstart.yaml"


def run_miles(cmd: list[str], log_path: Path, timeout_s: float) -> tuple[int, float, float]:
    """Run ``cmd``; (status, wall s, CPU s of its whole process tree). On timeout, SIGINT: `miles run` then
    stops its actors (they run in their own sessions, so killing the launcher alone would orphan them)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            status = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            status = 124
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return status, wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def checkpoint_seconds(trainer_log: Path) -> list[float]:
    """Save-to-durable seconds of every checkpoint the trainer completed (its ``checkpoint.complete`` lines)."""
    out = []
    for line in trainer_log.read_text(errors="replace").splitlines():
        if '"checkpoint.complete"' in line:
            out.append(float(json.loads(line)["seconds"]))
    return out


def run_once(every: int, args: argparse.Namespace, work: Path, log_dir: Path) -> dict[str, Any]:
    run_dir = work / f"every{every}-{time.time_ns()}"
    sets = [f"trainer.steps={args.steps}", f"trainer.checkpoint_every={every}", "eval.every=0", "monitor.plots=false"]
    if args.sync:
        sets.append("trainer.async_checkpoint=false")
    if args.model_cache:
        sets.append(f"model.cache_dir={args.model_cache}")
    cmd = [sys.executable, "-m", "miles.cli", "run", str(RECIPE), "--run-dir", str(run_dir), "--quiet"]
    for item in sets:
        cmd += ["--set", item]
    load_before = os.getloadavg()[0]
    log_path = log_dir / f"{run_dir.name}.log"
    status, wall, cpu = run_miles(cmd, log_path, args.timeout_s)
    if status != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise SystemExit(
            f"run failed (checkpoint_every={every}, status {status}; actor logs in {run_dir}/logs):\n{tail}"
        )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if len(rows) != args.steps:
        raise SystemExit(f"{run_dir}/metrics.jsonl has {len(rows)} steps, expected {args.steps}")
    rows.sort(key=lambda r: r["step"])
    window = rows[args.skip :]
    cadence = [b["time"] - a["time"] for a, b in zip(window, window[1:], strict=False)]
    step_s = [r["step_s"] for r in window]
    saves = checkpoint_seconds(run_dir / "logs" / "trainer-0.log")
    return {
        "checkpoint_every": every,
        "steps": len(rows),
        "cadence_s_median": statistics.median(cadence),
        "cadence_s_mean": statistics.fmean(cadence),
        "step_s_median": statistics.median(step_s),
        "step_s_mean": statistics.fmean(step_s),
        "window_s": window[-1]["time"] - window[0]["time"],
        "process_wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "checkpoints_saved": len(saves),
        "checkpoint_save_s_median": statistics.median(saves) if saves else None,
        "checkpoints_kept": sorted(p.name for p in (run_dir / "checkpoints").iterdir()),
        "eval_after": json.loads((run_dir / "summary.json").read_text()).get("eval_after"),
        "loadavg_1m_before": round(load_before, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
        "run_dir": str(run_dir),
    }


KEYS = ("cadence_s_median", "cadence_s_mean", "step_s_median", "step_s_mean", "process_wall_s", "cpu_s")


def summarize(runs: list[dict[str, Any]], intervals: list[int]) -> dict[str, Any]:
    """Per interval: the median over runs of each figure, and its ratio to the largest interval's."""
    summary: dict[str, Any] = {}
    for every in intervals:
        mine = [r for r in runs if r["checkpoint_every"] == every]
        summary[str(every)] = {"runs": len(mine), **{k: statistics.median(r[k] for r in mine) for k in KEYS}}
    base = summary[str(max(intervals))]
    for every in intervals:
        row = summary[str(every)]
        row["ratio_to_" + str(max(intervals))] = {k: round(row[k] / base[k], 3) for k in KEYS}
    return summary


def table(summary: dict[str, Any], base: int) -> str:
    lines = [
        f"| checkpoint_every | runs | cadence median s | cadence mean s | step_s median | step_s mean | wall s | CPU s "
        f"| cadence median / {base} | cadence mean / {base} | step_s median / {base} |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for every, row in summary.items():
        r = row["ratio_to_" + str(base)]
        lines.append(
            f"| {every} | {row['runs']} | {row['cadence_s_median']:.3f} | {row['cadence_s_mean']:.3f} | "
            f"{row['step_s_median']:.3f} | {row['step_s_mean']:.3f} | "
            f"{row['process_wall_s']:.1f} | {row['cpu_s']:.1f} | "
            f"{r['cadence_s_median']:.2f} | {r['cadence_s_mean']:.2f} | {r['step_s_median']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--intervals", default="1,10,100")
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the window (start-up)")
    parser.add_argument("--work", default="runs/bench-checkpoint")
    parser.add_argument("--model-cache", default=None)
    parser.add_argument("--sync", action="store_true", help="synchronous checkpoints")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    parser.add_argument("--out", default="benchmarks/results/checkpoint_interval.json")
    args = parser.parse_args()
    intervals = [int(x) for x in args.intervals.split(",")]
    if args.steps < args.skip + 3:
        parser.error(f"--steps must exceed --skip ({args.skip}) by at least 3")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    for round_ in range(args.repeats):
        order = intervals if round_ % 2 == 0 else list(reversed(intervals))
        for every in order:
            result = run_once(every, args, work, work)
            result["round"] = round_
            runs.append(result)
            print(json.dumps(result), flush=True)
    summary = summarize(runs, intervals)
    out = {
        "command": "python benchmarks/checkpoint_interval.py " + " ".join(sys.argv[1:]),
        "synchronous": args.sync,
        "skip": args.skip,
        "cpus": os.cpu_count(),
        "summary": summary,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(table(summary, max(intervals)))


if __name__ == "__main__":
    main()
