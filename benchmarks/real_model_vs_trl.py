"""Miles vs TRL's GRPOTrainer on a real model: time to a held-out accuracy and accuracy at equal wall time, per seed.

    python benchmarks/real_model_vs_trl.py --out /tmp/bench/real_vs_trl.json           # 2 seeds, about an hour
    python benchmarks/real_model_vs_trl.py --seeds 0 --set trainer.steps=2 --set eval.max_samples=8 \\
        --out /tmp/rmvt.json                                                            # quick check
    python benchmarks/real_model_vs_trl.py --recipe recipes/quickstart.yaml --seeds 0 1 2 3 4 --eval-every 100 \
        --cores 0-1 --out benchmarks/results/quickstart_vs_trl_5seeds.json              # the quickstart, ~30 min

The recipe (default ``recipes/smollm2-135m.yaml``: SmolLM2-135M-Instruct, LoRA rank 8, conversational rows
rendered with the chat template, 8 groups x 4 per step, 40 steps) is run by both frameworks with the same
model, task, reward, LoRA, sample budget, optimizer and learning-rate curve, and the same evaluation (Miles'
own, greedy, on the same held-out rows, every ``--eval-every`` versions on both sides): see
``benchmarks/trl_grpo.py`` for what is aligned and what is not (``NOT_ALIGNED``). For each seed in ``--seeds``
(``--set seed=S --set trainer.seed=S`` on both sides), one after the other, never concurrently (the first
side alternates from seed to seed, so a machine's drift does not always favour the same side):

1. Miles: ``python -m miles.cli run RECIPE --run-dir <tmp> --quiet --set ...``; its curve is read from the run
   directory: each evaluation in ``evals.jsonl`` knows how many steps its version had trained, and the
   version's time is when that step's record was written to ``metrics.jsonl`` (not when the evaluation
   finished); the clock starts when the controller issued the first training prompts (``groups.jsonl``),
   after start-up and the evaluation of version 0;
2. TRL: ``python benchmarks/trl_grpo.py --threads <every core> --max-wall-s CAP``; its clock starts when
   training begins and leaves out the time of its evaluations (they run between steps).

Each side is capped at ``--max-wall-s`` (default 1200) of training clock: TRL stops itself before a step
that would end past it; Miles has no cap of its own, so its points past the cap are dropped (and a run that
outlasts the cap by ``--grace-s`` is stopped). Reported, per seed and side:

* the accuracy curve: ``(step, seconds since training began, accuracy)``;
* the time to a target held-out accuracy both sides reach (``--target``, default: the smaller of the two
  final accuracies), the first evaluated version at or above it;
* the accuracy at equal wall time: each side's last evaluated version at the shorter side's end time;
* time per step (median from the second step: Miles, between consecutive step records; TRL, between
  ``on_step_end`` callbacks, evaluations left out) and CPU seconds per step: of the whole process tree over
  the whole run (start-up and evaluations included), and of the training window only (sampled with psutil,
  from the clock's start to the last step, evaluations included on both sides);
* the ratios Miles/TRL, and their mean over seeds with its standard error.

``--cores`` pins both sides to the same cores (TRL then runs one torch thread per core, as torch's default
would; Miles' processes share them).

A shared machine. Before each side the driver waits (up to ``--quiet-wait-s``) for the 1-minute load average
to fall below ``--quiet-load``, and it records how many cores other processes kept busy during each side's
training window (``other_cores_window``, from the machine's and the tree's CPU samples). This matters more
for TRL than for Miles: TRL's one process runs two intra-op threads that meet at a barrier after every small
op, so a core taken by anything else stalls every decode step (a 32-row decode step of this model measured
0.2 s on a quiet machine and 4 s beside a test suite), while each Miles process runs one thread. A result
with ``other_cores_window`` well above 0 on either side is not a comparison of the frameworks.

How evaluations count. TRL's evaluations stop its training and are taken off its clock, so they cost it nothing.
Miles' evaluations of versions 5, 10, ... run on its only rollout worker while the trainer goes on (with
``eval.hold_rollouts`` the worker starts no training rollout during one), so they delay Miles' later steps and
are in its clock. The main figures use these clocks (as issue 33 asks); two other clocks bracket the
evaluations' share: ``evals_out_both`` also takes Miles' evaluation windows (request to result, from the
controller log) off its clock, which overstates what they cost it (the trainer keeps training meanwhile), and
``evals_in_both`` puts TRL's evaluation time back on its clock.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from miles_vs_trl import THREAD_ENV, child_env, cpu_between, miles_threads, run_measured, tail  # noqa: E402

from miles.config import ConfigError, add_override_option, load_config  # noqa: E402

CLOCKS = {  # name -> (Miles' time field, TRL's time field)
    "main": ("t", "t"),
    "evals_out_both": ("t_evals_out", "t"),
    "evals_in_both": ("t", "t_evals_in"),
}
SAMPLE_CPU_S = 2.0  # seconds between the CPU samples of a side's process tree


def _log(msg: str) -> None:
    print(f"[real_model_vs_trl] {msg}", file=sys.stderr, flush=True)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a torn last line of a stopped run
    return rows


def _epoch(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def eval_windows(controller_log: Path, started_at: float) -> list[tuple[float, float]]:
    """``(request, result)`` seconds since the run started of each evaluation of a version after 0, from the
    controller's ``eval_requested`` and ``eval`` events."""
    requested: dict[int, float] = {}
    windows = []
    for row in _read_jsonl(controller_log):
        version, event = row.get("version"), row.get("event")
        if not isinstance(version, int) or version == 0 or "timestamp" not in row:
            continue
        if event == "eval_requested":
            requested.setdefault(version, _epoch(row["timestamp"]) - started_at)
        elif event == "eval" and version in requested:
            windows.append((requested.pop(version), _epoch(row["timestamp"]) - started_at))
    return windows


def _overlap(windows: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in windows)


def read_miles_run(run_dir: Path) -> dict[str, Any]:
    """The curve and step times of a ``miles run`` directory (see the module docstring for the clock)."""
    started_at = float((run_dir / "started_at").read_text())
    by_step = {r["step"]: r for r in reversed(_read_jsonl(run_dir / "metrics.jsonl"))}  # the first line of a step
    metrics = [by_step[step] for step in sorted(by_step)]
    evals = {}
    for row in _read_jsonl(run_dir / "evals.jsonl"):
        if row.get("eval_accuracy") is not None:
            evals.setdefault(int(row["step"]), float(row["eval_accuracy"]))
    issued = [r["t"] for r in _read_jsonl(run_dir / "groups.jsonl") if r.get("event") == "issued"]
    # The clock starts with the first training prompts (failing that, the evaluation of version 0).
    eval0 = next((r["time"] for r in _read_jsonl(run_dir / "evals.jsonl") if r.get("step") == 0), 0.0)
    t0 = min(issued) - started_at if issued else float(eval0)
    step_time = {int(r["step"]) + 1: float(r["time"]) for r in metrics}  # steps trained -> record time
    windows = eval_windows(run_dir / "logs" / "controller.log", started_at)
    points = []
    for step in sorted(evals):
        at = t0 if step == 0 else step_time.get(step)
        if at is None:
            continue  # an evaluated version whose step record is missing
        points.append(
            {
                "step": step,
                "accuracy": evals[step],
                "t": round(at - t0, 3),
                "t_evals_out": round(at - t0 - _overlap(windows, t0, at), 3),
            }
        )
    times = [float(r["time"]) for r in metrics]
    cadence = [b - a for a, b in zip(times, times[1:], strict=False)]  # from the second step on
    return {
        "points": points,
        "steps": len(metrics),
        "started_at": started_at,
        "clock_start_s": round(t0, 3),  # since the controller started
        "train_begin_time": started_at + t0,
        "train_end_time": started_at + times[-1] if times else None,
        "step_s_median": statistics.median(cadence) if cadence else None,
        "step_s": [round(s, 3) for s in cadence],
        "eval_windows": [[round(a, 3), round(b, 3)] for a, b in windows],
        "staleness_mean": statistics.fmean(r.get("staleness_mean", 0.0) for r in metrics) if metrics else None,
    }


def trl_points(trl: dict[str, Any]) -> list[dict[str, Any]]:
    """trl_grpo.py's evaluations as curve points (``t``: training clock; ``t_evals_in``: evaluations included)."""
    return [
        {"step": e["step"], "accuracy": e["accuracy"], "t": e["train_s"], "t_evals_in": e["wall_s"]}
        for e in trl.get("evals", [])
    ]


def time_to(points: list[dict[str, Any]], target: float, clock: str) -> dict[str, Any] | None:
    """The first evaluated version at or above ``target``: its step and time; None if none is."""
    hit = next((p for p in points if p["accuracy"] >= target - 1e-9), None)
    return None if hit is None else {"step": hit["step"], "t": hit[clock]}


def accuracy_at(points: list[dict[str, Any]], t: float, clock: str) -> float | None:
    """The accuracy of the last version evaluated at or before ``t``."""
    seen = [p for p in points if p[clock] <= t + 1e-9]
    return seen[-1]["accuracy"] if seen else None


def _ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, int | float) or not isinstance(b, int | float) or b == 0:
        return None
    return a / b


def compare(miles: dict[str, Any], trl: dict[str, Any], cap: float, target: float | None) -> dict[str, Any]:
    """Time to target, accuracy at equal time, step time and CPU per step, Miles/TRL, under each of ``CLOCKS``."""
    out: dict[str, Any] = {}
    finals = {}
    for name, (mc, tc) in CLOCKS.items():
        m = [p for p in miles.get("points", []) if p[mc] <= cap]
        t = [p for p in trl.get("points", []) if p[tc] <= cap]
        if not m or not t:
            out[name] = {"error": "a side has no evaluation within the cap"}
            continue
        if name == "main":
            finals = {"miles": m[-1]["accuracy"], "trl": t[-1]["accuracy"]}
        goal = target if target is not None else min(finals.values())
        reach_m, reach_t = time_to(m, goal, mc), time_to(t, goal, tc)
        equal_t = min(m[-1][mc], t[-1][tc])
        acc_m, acc_t = accuracy_at(m, equal_t, mc), accuracy_at(t, equal_t, tc)
        out[name] = {
            "target": goal,
            "time_to_target_miles": reach_m,
            "time_to_target_trl": reach_t,
            "time_to_target_miles_over_trl": _ratio(reach_m and reach_m["t"], reach_t and reach_t["t"]),
            "equal_time_s": equal_t,
            "accuracy_at_equal_time_miles": acc_m,
            "accuracy_at_equal_time_trl": acc_t,
            "accuracy_at_equal_time_miles_minus_trl": None if acc_m is None or acc_t is None else acc_m - acc_t,
        }
    out["final_accuracy"] = finals
    out["step_s_median_miles_over_trl"] = _ratio(miles.get("step_s_median"), trl.get("step_s_median"))
    for key in ("cpu_s_per_step_tree", "cpu_s_per_step_window"):
        out[f"{key}_miles_over_trl"] = _ratio(miles.get(key), trl.get(key))
    return out


def cpu_per_step(side: dict[str, Any], samples: list[tuple[float, float, float]]) -> None:
    """Adds to ``side`` the CPU seconds per step of the whole process tree and of its training window, and the
    cores that other processes of the machine kept busy meanwhile (0 on a quiet machine)."""
    steps = side.get("steps") or 0
    side["cpu_s_per_step_tree"] = side["cpu_s"] / steps if steps else None
    begin, end = side.get("train_begin_time"), side.get("train_end_time")
    window = cpu_between(samples, begin, end) if begin and end else None
    machine = cpu_between(samples, begin, end, column=2) if begin and end else None
    side["cpu_s_window"] = None if window is None else round(window, 2)
    side["cpu_s_per_step_window"] = window / steps if window is not None and steps else None
    busy = window is not None and machine is not None and end > begin
    side["other_cores_window"] = round((machine - window) / (end - begin), 3) if busy else None


def wait_quiet(max_load: float, max_wait_s: float) -> dict[str, Any]:
    """Wait (up to ``max_wait_s``) until the 1-minute load average is below ``max_load``: a side started on a
    busy machine measures the scheduler (TRL's intra-op threads spin at every barrier when a core is taken)."""
    start = time.perf_counter()
    while os.getloadavg()[0] >= max_load and time.perf_counter() - start < max_wait_s:
        time.sleep(15)
    load, waited = os.getloadavg()[0], time.perf_counter() - start
    if waited > 1:
        _log(f"waited {waited:.0f} s for a quiet machine: 1-minute load {load:.2f} (limit {max_load})")
    return {"quiet_wait_s": round(waited, 1), "loadavg_1m_at_start": round(load, 2), "quiet": load < max_load}


def run_miles(recipe: str, overrides: list[str], work: Path, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    run_dir = work / "miles-run"
    cmd = [sys.executable, "-m", "miles.cli", "run", recipe, "--run-dir", str(run_dir), "--quiet"]
    cmd += [x for o in overrides for x in ("--set", o)]
    _log(f"miles: {' '.join(cmd[1:])}")
    proc = run_measured(cmd, env, work / "miles.log", timeout_s, sample_cpu_s=SAMPLE_CPU_S)
    samples = proc.pop("cpu_samples")
    side: dict[str, Any] = {"framework": "miles", "run_dir": str(run_dir), **proc}
    if (run_dir / "started_at").is_file():
        side.update(read_miles_run(run_dir))
        summary = run_dir / "summary.json"
        if summary.is_file():
            side["summary"] = {k: v for k, v in json.loads(summary.read_text()).items() if not isinstance(v, dict)}
    if not side.get("points"):
        side["error"] = f"miles run exited with status {proc['returncode']} and no evaluations; log: {proc['log']}"
        side["log_tail"] = tail(work / "miles.log")
    elif proc["returncode"] != 0:
        side["warning"] = f"exited with status {proc['returncode']} (124: stopped past the cap); curve kept"
    cpu_per_step(side, samples)
    return side


def run_trl(
    recipe: str, overrides: list[str], work: Path, env: dict[str, str], threads: int, cap: float, timeout_s: float
) -> dict[str, Any]:
    result_path = work / "trl.json"
    cmd = [sys.executable, str(HERE / "trl_grpo.py"), "--recipe", recipe, "--out", str(result_path)]
    cmd += ["--threads", str(threads), "--max-wall-s", str(cap)]
    cmd += [x for o in overrides for x in ("--set", o)]
    _log(f"trl: {' '.join(cmd[1:])}")
    proc = run_measured(cmd, env, work / "trl.log", timeout_s, sample_cpu_s=SAMPLE_CPU_S)
    samples = proc.pop("cpu_samples")
    if proc["returncode"] != 0 or not result_path.is_file():
        return {
            "framework": "trl",
            **proc,
            "log_tail": tail(work / "trl.log"),
            "error": f"trl_grpo.py exited with status {proc['returncode']}; log: {proc['log']}",
        }
    side = {**json.loads(result_path.read_text()), **proc}
    side.pop("log_history", None)
    side["points"] = trl_points(side)
    cpu_per_step(side, samples)
    return side


def parse_cores(text: str) -> set[int]:
    """``0-3,6`` -> {0, 1, 2, 3, 6} (``ValueError`` naming ``--cores`` otherwise)."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            cores.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(f"--cores {text!r}: expected a list like 0-3 or 0,2") from None
    if not cores:
        raise ValueError(f"--cores {text!r}: no core")
    return cores


def mean_over_seeds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean over seeds of every ratio and difference the seeds have, its standard error (None for one seed)
    and the count."""
    keys: dict[str, list[float]] = {}
    for run in runs:
        comp = run["comparison"]
        for name in CLOCKS:
            for key, value in comp.get(name, {}).items():
                if key.endswith(("_over_trl", "_minus_trl")) and isinstance(value, int | float):
                    keys.setdefault(f"{name}.{key}", []).append(value)
        for key, value in comp.items():
            if key.endswith("_over_trl") and isinstance(value, int | float):
                keys.setdefault(key, []).append(value)
    return {
        k: {
            "mean": statistics.fmean(v),
            "se": statistics.stdev(v) / len(v) ** 0.5 if len(v) > 1 else None,
            "seeds": len(v),
        }
        for k, v in keys.items()
    }


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _curve(points: list[dict[str, Any]], clock: str) -> str:
    return ", ".join(f"{p['step']}: {p[clock]:.0f} s {p['accuracy']:.2f}" for p in points)


def markdown(result: dict[str, Any]) -> str:
    """Per-seed tables and the mean of the ratios over seeds."""
    lines = []
    for run in result["runs"]:
        miles, trl, comp = run["miles"], run["trl"], run["comparison"]
        main = comp.get("main", {})
        lines += [f"### seed {run['seed']} ({' then '.join(run['order'])})", ""]
        for side in (miles, trl):
            if side.get("error"):
                lines.append(f"**{side['framework']} failed**: {side['error']}")
        if main.get("error") or "target" not in main:
            lines += [f"no comparison: {main.get('error')}", ""]
            continue
        goal, equal_t = main["target"], main["equal_time_s"]
        reach_m, reach_t = main["time_to_target_miles"], main["time_to_target_trl"]
        rows = [
            ("steps done", miles.get("steps"), trl.get("steps"), None),
            ("time per step, median (s)", miles.get("step_s_median"), trl.get("step_s_median"),
             comp["step_s_median_miles_over_trl"]),
            (f"time to accuracy {goal:.2f} (s)", reach_m and reach_m["t"], reach_t and reach_t["t"],
             main["time_to_target_miles_over_trl"]),
            ("... at step", reach_m and reach_m["step"], reach_t and reach_t["step"], None),
            (f"accuracy at {equal_t:.0f} s (equal time)", main["accuracy_at_equal_time_miles"],
             main["accuracy_at_equal_time_trl"], None),
            ("final accuracy (within the cap)", comp["final_accuracy"].get("miles"),
             comp["final_accuracy"].get("trl"), None),
            ("CPU s per step, process tree, whole run", miles.get("cpu_s_per_step_tree"),
             trl.get("cpu_s_per_step_tree"), comp["cpu_s_per_step_tree_miles_over_trl"]),
            ("CPU s per step, training window", miles.get("cpu_s_per_step_window"),
             trl.get("cpu_s_per_step_window"), comp["cpu_s_per_step_window_miles_over_trl"]),
            ("other processes' cores busy, training window", miles.get("other_cores_window"),
             trl.get("other_cores_window"), None),
            ("1-minute load at start", miles.get("loadavg_1m_at_start"), trl.get("loadavg_1m_at_start"), None),
        ]  # fmt: skip
        for name in ("evals_out_both", "evals_in_both"):
            other = comp.get(name, {})
            rows.append((f"time to target, clock {name}", None, None, other.get("time_to_target_miles_over_trl")))
        lines += ["| | Miles | TRL | Miles/TRL |", "|---|---|---|---|"]
        lines += [f"| {n} | {_fmt(m)} | {_fmt(t)} | {_fmt(r, 2)} |" for n, m, t, r in rows]
        lines += [
            "",
            f"Miles curve (step: s since training began, accuracy): {_curve(miles.get('points', []), 't')}",
            f"TRL curve (step: training clock s, accuracy): {_curve(trl.get('points', []), 't')}",
            "",
        ]
    if result["mean"]:
        lines += [
            f"### mean over {len(result['runs'])} seed(s)",
            "",
            "| ratio or difference | mean | standard error | seeds |",
        ]
        lines += ["|---|---|---|---|"]
        lines += [
            f"| {k} | {_fmt(v['mean'])} | {_fmt(v.get('se'))} | {v['seeds']} |" for k, v in result["mean"].items()
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="recipes/smollm2-135m.yaml", help="Miles recipe (default: %(default)s).")
    add_override_option(p)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="Seeds (default: 0 1).")
    p.add_argument("--eval-every", type=int, default=5, help="eval.every on both sides (default 5).")
    p.add_argument("--max-wall-s", type=float, default=1200.0, help="Cap on each side's training clock (s).")
    p.add_argument("--grace-s", type=float, default=900.0, help="A side still running at cap + this is stopped.")
    p.add_argument("--target", type=float, help="Target held-out accuracy (default: the smaller final accuracy).")
    p.add_argument(
        "--cores",
        help="Pin both sides to these cores, e.g. 0-3 or 0,2 (default: every core this process may use).",
    )
    p.add_argument("--trl-threads", type=int, help="torch intra-op threads of TRL (default: one per core it has).")
    p.add_argument("--env-threads", type=int, default=1, help="OMP/MKL/OpenBLAS limit in both environments.")
    p.add_argument(
        "--quiet-load",
        type=float,
        default=1.0,
        help="Before each side, wait until the 1-minute load average is below this (default 1.0; 0: never wait).",
    )
    p.add_argument("--quiet-wait-s", type=float, default=1800.0, help="Longest wait for a quiet machine (s).")
    p.add_argument("--out", help="Write the result JSON here.")
    p.add_argument("--keep", action="store_true", help="Keep the work directory (run dirs, logs).")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.recipe, args.overrides)
        if args.cores:
            os.sched_setaffinity(0, parse_cores(args.cores))  # both sides inherit it: the same cores
    except (ConfigError, ValueError, OSError) as exc:
        print(f"real_model_vs_trl: error: {exc}", file=sys.stderr)
        return 2
    cores = sorted(os.sched_getaffinity(0))
    trl_threads = args.trl_threads or len(cores)

    from miles.prepare import prepare_model

    start = time.perf_counter()
    model_dir = prepare_model(cfg)  # convert once, outside both measurements
    _log(f"model ready in {time.perf_counter() - start:.1f}s: {model_dir}")
    env = child_env(args.env_threads)
    work = Path(tempfile.mkdtemp(prefix="real-model-vs-trl-"))
    runs = []
    for index, seed in enumerate(args.seeds):
        overrides = [*args.overrides, f"seed={seed}", f"trainer.seed={seed}", f"eval.every={args.eval_every}"]
        seed_dir = work / f"seed{seed}"
        seed_dir.mkdir(parents=True, exist_ok=True)
        order = ("miles", "trl") if index % 2 == 0 else ("trl", "miles")
        sides: dict[str, dict[str, Any]] = {}
        for side in order:
            quiet = wait_quiet(args.quiet_load, args.quiet_wait_s) if args.quiet_load > 0 else {}
            if side == "miles":
                timeout = args.max_wall_s + args.grace_s
                sides["miles"] = run_miles(args.recipe, overrides, seed_dir, env, timeout)
            else:
                timeout = args.max_wall_s + 2 * args.grace_s  # its evaluations are off its clock, not its wall
                sides["trl"] = run_trl(args.recipe, overrides, seed_dir, env, trl_threads, args.max_wall_s, timeout)
            sides[side].update(quiet)
            if sides[side].get("error"):
                _log(f"{side.upper()} FAILED: {sides[side]['error']}\n{sides[side].get('log_tail', '')}")
        comparison = compare(sides["miles"], sides["trl"], args.max_wall_s, args.target)
        runs.append({"seed": seed, "order": list(order), **sides, "comparison": comparison, "overrides": overrides})
        _log(f"seed {seed}: {json.dumps(comparison.get('main'))}")

    result = {
        "recipe": args.recipe,
        "overrides": args.overrides,
        "seeds": args.seeds,
        "eval_every": args.eval_every,
        "max_wall_s": args.max_wall_s,
        "target": args.target,
        "budget": {
            "steps": cfg.trainer.steps,
            "groups_per_step": cfg.trainer.groups_per_step,
            "group_size": cfg.rollout.group_size,
            "max_new_tokens": cfg.rollout.sampling.max_new_tokens,
            "lora": None if cfg.trainer.lora is None else cfg.trainer.lora.model_dump(),
            "eval_samples": cfg.eval.max_samples,
        },
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "env_threads": {name: env[name] for name in THREAD_ENV},
        "cores": cores,
        "trl_threads": trl_threads,
        "miles_threads": miles_threads(cfg),
        "runs": runs,
        "mean": mean_over_seeds(runs),
        "work_dir": str(work),
    }
    text = markdown(result)
    print(text)
    result["markdown"] = text
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        _log(f"wrote {args.out}")
    failed = any(run[side].get("error") for run in runs for side in ("miles", "trl"))
    if args.keep or failed:
        _log(f"work directory kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
