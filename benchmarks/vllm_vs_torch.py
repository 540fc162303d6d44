"""vLLM against the embedded torch engine on the quickstart, side by side: whole `miles run`s, interleaved.

    python benchmarks/vllm_vs_torch.py --steps 30 --pairs 1 --out benchmarks/results/vllm_vs_torch.json

Each pair runs `recipes/quickstart.yaml` (torch engine) and `recipes/quickstart-vllm.yaml` (a vLLM CPU server
the worker starts, float32) for ``--steps`` steps with the same seed, then a third arm, vLLM with
``sync.mode=delta``. Per arm it reports the median step time and generation tokens/s (metrics.jsonl), the
weight update's cost per version (bytes published per version from the trainer's log; from the worker's log,
vLLM's pause per version, median and p90: ``pause_ms`` from /pause's reply to /resume's, when the server is
paused, and ``switch_ms`` from the pause request on, which holds the step in progress too),
CPU seconds of the whole run, and held-out accuracy before and after. The two recipes differ only in the
engine and in the model's head count (vLLM's CPU attention needs head_dim >= 32: 2 heads of 32, not 4 of 16),
so the models have the same parameter count but are not the same model.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = {
    "torch": ["recipes/quickstart.yaml"],
    "vllm": ["recipes/quickstart-vllm.yaml"],
    "vllm_delta": ["recipes/quickstart-vllm.yaml", "--set", "sync.mode=delta"],
}


def events(path: Path, name: str) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if f'"{name}"' in line:
            out.append(json.loads(line))
    return out


def run_arm(arm: str, steps: int, seed: int, root: Path) -> dict:
    run_dir = root / f"{arm}-s{seed}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "miles.cli", "run", *ARMS[arm], "--run-dir", str(run_dir), "--quiet"]
    cmd += ["--set", f"trainer.steps={steps}", "--set", f"seed={seed}", "--set", f"eval.every={steps}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    published = events(run_dir / "logs" / "trainer-0.log", "weights_published")
    loaded = events(run_dir / "logs" / "rollout-0.log", "vllm_weights_loaded")
    steady = metrics[len(metrics) // 5 :] or metrics  # past the first steps (start-up, first syncs)
    result = {
        "arm": arm,
        "seed": seed,
        "steps": len(metrics),
        "step_s_median": statistics.median(m["step_s"] for m in steady),
        "tokens_per_s_median": statistics.median(m["tokens_per_s"] for m in steady),
        "wall_s": round(wall, 1),
        "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
        "bytes_per_version_median": statistics.median(p["bytes"] for p in published[1:] or published),
        "eval_before": summary.get("eval_before"),
        "eval_after": summary.get("eval_after"),
        "weights_verified": summary.get("weights_verified"),
        "weights_mismatches": summary.get("weights_mismatches"),
        "status": summary.get("status"),
    }
    result["pause_ms_median"] = result["pause_ms_p90"] = None  # torch: its heartbeat has the switch pause
    result["switch_ms_median"] = result["switch_ms_p90"] = None
    for key in ("pause_ms", "switch_ms"):  # vLLM: paused, and from the pause request on (step in progress too)
        values = [e[key] for e in loaded[1:] or loaded if key in e]
        if values:
            result[f"{key}_median"] = statistics.median(values)
            result[f"{key}_p90"] = statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="vllm_vs_torch-"))
    rows = []
    for pair in range(args.pairs):
        for arm in args.arms:
            row = run_arm(arm, args.steps, seed=pair, root=root)
            rows.append(row)
            print(json.dumps(row), flush=True)
    by_arm = {arm: [r for r in rows if r["arm"] == arm] for arm in args.arms}
    if "torch" in by_arm and "vllm" in by_arm:
        ratios = [v["step_s_median"] / t["step_s_median"] for t, v in zip(by_arm["torch"], by_arm["vllm"], strict=True)]
        cpu = [v["cpu_s"] / t["cpu_s"] for t, v in zip(by_arm["torch"], by_arm["vllm"], strict=True)]
        print(f"vllm/torch step time, per pair: {[round(r, 2) for r in ratios]}; CPU: {[round(c, 2) for c in cpu]}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
