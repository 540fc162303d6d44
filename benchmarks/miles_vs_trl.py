"""Miles vs TRL's GRPOTrainer on one recipe, in one run: time per optimizer step and held-out accuracy.

    python benchmarks/miles_vs_trl.py --recipe recipes/quickstart.yaml --out benchmarks/results/miles_vs_trl.json

Quick check (both sides, 3 steps):

    python benchmarks/miles_vs_trl.py --recipe recipes/quickstart.yaml --set trainer.steps=3 --out /tmp/mvt.json

Paired (``--pairs N``): N Miles runs and N TRL runs, interleaved M T, T M, M T, ... The ratios of each pair are
taken between two runs minutes apart, so a shared machine's drift in speed (it moved CPU per step by 1.5x
within an hour on the development machine) cancels within a pair; the headline is the median over pairs.

    python benchmarks/miles_vs_trl.py --recipe recipes/quickstart.yaml --pairs 3 \\
        --out benchmarks/results/miles_vs_trl.json

Runs, one after the other (never concurrently, so neither steals the other's cores):

1. Miles: ``python -m miles.cli run RECIPE --run-dir <tmp> --quiet``; reads the run's ``summary.json``
   (eval_before, eval_after, wall_s) and ``metrics.jsonl`` (step_s of every optimizer step);
2. TRL: ``python benchmarks/trl_grpo.py`` (same recipe and overrides), which reproduces the recipe's
   model, prompts, reward and sample budget with ``trl.GRPOTrainer`` and scores the result with Miles'
   own evaluator (see that file for what is and is not aligned).

Each side is a separate process so that they share no torch state (intra-op pool, RNG, allocator).
Both get the same environment thread limits (``OMP_NUM_THREADS`` etc., ``--threads``). Miles runs
several processes (controller, ``rollout.workers`` workers, ``trainer.ranks`` ranks, a nats-server)
whose per-process torch threads come from the recipe (``rollout.engine.threads``,
``trainer.backend.threads``), and its launcher pins ``OMP_NUM_THREADS=1`` in every actor; TRL is one
process, and by default its torch intra-op pool gets every core this process may run on (as torch's own
default would), so neither side has cores the other lacks. The JSON records what each used,
plus the CPU seconds of each side's whole process tree, so a reader can tell a speed-up from a side
that merely used more cores.

Wall times: ``process_wall_s`` is measured here for both sides alike (start-up, model load, the
evaluations and training) and is the one the ratio uses; ``wall_s`` is what each side reports itself
(Miles: from its controller's start to the summary; TRL: from interpreter start, imports included).
Time per step, both sides from their second step on (the first pays each side's start-up):

* Miles: the interval between consecutive steps' records in ``metrics.jsonl`` (``time``, when the
  controller received each step's report), so it covers everything the trainer does per step: waiting
  for trajectories, the update, the weight export and publish, the acks, the periodic checkpoint
  (``trainer.checkpoint_every``); the periodic evaluations (``eval.every``) run on the rollout workers
  meanwhile and cost the step only the CPU they take. The trainer's own ``step_s`` misses the step's
  acks, report and checkpoint (it ends at the publish); it is kept as ``trainer_step_s_*``.
* TRL: the interval between consecutive ``on_step_end`` callbacks: generation, scoring, the update and
  TRL's logging; it saves nothing and evaluates only before and after.

The model is built (or found in the cache) before either run, so neither pays the one-off build.
If the Miles run fails the TRL side still runs; the failure is reported and the exit status is 1.

For a pretrained model (LoRA, chat template), with accuracy curves, time to a target accuracy and accuracy at
equal wall time per seed, see ``benchmarks/real_model_vs_trl.py``, which reuses this file's process runner.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from miles.config import (
    ConfigError,
    FsdpBackendConfig,
    RunConfig,
    TorchEngineConfig,
    add_override_option,
    load_config,
)

HERE = Path(__file__).resolve().parent
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _log(msg: str) -> None:
    print(f"[miles_vs_trl] {msg}", file=sys.stderr, flush=True)


def child_env(threads: int) -> dict[str, str]:
    """The environment of both sides: same BLAS/OpenMP limits, no tokenizer thread pool, no telemetry."""
    env = dict(os.environ)
    env.update({name: str(threads) for name in THREAD_ENV})
    env.update(
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_DISABLED="true",
        WANDB_MODE="disabled",
    )
    return env


class TreeCpuSampler:
    """Samples the CPU seconds (user + system) of a process and all its descendants every ``interval_s``
    (psutil), with the whole machine's busy CPU seconds, as ``(epoch seconds, tree CPU, machine CPU)``, so that
    the CPU of a window of a run (its training, say), and what other processes took meanwhile, can be read off.
    Reaped children's CPU is in their parent's ``children_*`` times, so the sum over the live tree does not
    drop when an actor exits while its parent lives."""

    def __init__(self, pid: int, interval_s: float) -> None:
        import threading

        self.pid = pid
        self.interval_s = interval_s
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)

    def tree_cpu_s(self) -> float | None:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return None
        total = 0.0
        for proc in procs:
            try:
                t = proc.cpu_times()
            except psutil.Error:
                continue  # exited meanwhile: its CPU is now its parent's children_* time
            total += t.user + t.system + t.children_user + t.children_system
        return total

    def _loop(self) -> None:
        import psutil

        while not self._stop.is_set():
            cpu = self.tree_cpu_s()
            machine = psutil.cpu_times()
            busy = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
            if cpu is not None:
                self.samples.append((round(time.time(), 3), round(cpu, 3), round(busy, 3)))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> TreeCpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def cpu_between(samples: list[tuple[float, ...]], start: float, end: float, column: int = 1) -> float | None:
    """CPU seconds spent between epoch times ``start`` and ``end``, linearly interpolated between the samples of a
    :class:`TreeCpuSampler` (``column`` 1: the process tree, 2: the whole machine); None when the samples do not
    cover the window."""

    def at(t: float) -> float | None:
        for a, b in zip(samples, samples[1:], strict=False):
            if a[0] <= t <= b[0]:
                c0, c1 = a[column], b[column]
                return c0 if b[0] == a[0] else c0 + (c1 - c0) * (t - a[0]) / (b[0] - a[0])
        return None

    a, b = at(start), at(end)
    return None if a is None or b is None else b - a


def run_measured(
    cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float, sample_cpu_s: float | None = None
) -> dict[str, Any]:
    """Run ``cmd`` to completion; return its status, wall seconds and the CPU seconds of its whole process tree.

    CPU time comes from ``RUSAGE_CHILDREN``, which counts every descendant that was waited for (the
    Miles launcher waits for its actors and the nats-server), so it is the cost of the whole side.
    With ``sample_cpu_s``, the tree's CPU is also sampled that often (``cpu_samples``, see
    :class:`TreeCpuSampler`).
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    samples: list[tuple[float, float, float]] = []
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        sampler = TreeCpuSampler(proc.pid, sample_cpu_s) if sample_cpu_s else contextlib.nullcontext()
        with sampler:
            try:
                status = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                # SIGINT first: `miles run` then stops its actors (they run in their own sessions, so killing
                # the launcher alone would orphan them).
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                status = 124
        if isinstance(sampler, TreeCpuSampler):
            samples = sampler.samples
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    out: dict[str, Any] = {
        "returncode": status,
        "process_wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "loadavg_1m_before": round(load, 2),
        "command": cmd,
        "log": str(log_path),
    }
    if sample_cpu_s:
        out["cpu_samples"] = samples
    return out


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def miles_threads(cfg: RunConfig) -> dict[str, Any]:
    """Processes and torch intra-op threads of a local ``miles run`` of ``cfg`` (the launcher sets OMP=1)."""
    engine = cfg.rollout.engine
    backend = cfg.trainer.backend
    return {
        "processes": {
            "controller": 1,
            "rollout_workers": cfg.rollout.workers,
            "trainer_ranks": cfg.trainer.ranks,
            "nats_server": 0 if cfg.bus.nats_url else 1,
        },
        "torch_intra_op_per_rollout_worker": engine.threads if isinstance(engine, TorchEngineConfig) else None,
        "torch_intra_op_per_trainer_rank": backend.threads if isinstance(backend, FsdpBackendConfig) else None,
        "OMP_NUM_THREADS": "1 (set by the miles launcher in every actor)",
    }


def run_miles(
    recipe: str, overrides: list[str], cfg: RunConfig, work: Path, env: dict[str, str], timeout_s: float
) -> dict[str, Any]:
    """``miles run`` as a subprocess; the result dict, or one with ``error`` when the run failed."""
    run_dir = work / "miles-run"
    cmd = [sys.executable, "-m", "miles.cli", "run", recipe, "--run-dir", str(run_dir), "--quiet"]
    cmd += [x for o in overrides for x in ("--set", o)]
    _log(f"miles: {' '.join(cmd[1:])}")
    proc = run_measured(cmd, env, work / "miles.log", timeout_s)
    out: dict[str, Any] = {"framework": "miles", "run_dir": str(run_dir), "threads": miles_threads(cfg), **proc}
    summary_path, metrics_path = run_dir / "summary.json", run_dir / "metrics.jsonl"
    if proc["returncode"] != 0 or not summary_path.is_file():
        why = "timed out" if proc["returncode"] == 124 else f"exited with status {proc['returncode']}"
        if proc["returncode"] == 0:
            why = "finished without writing summary.json"
        out["error"] = f"miles run {why}; log: {proc['log']} (actor logs: {run_dir / 'logs'})"
        out["log_tail"] = tail(work / "miles.log")
        return out
    summary = json.loads(summary_path.read_text())
    raw = metrics_path.read_text().splitlines() if metrics_path.is_file() else []
    lines = [json.loads(x) for x in raw if x.strip()]
    lines.sort(key=lambda x: x["step"])
    step_s = [float(x["step_s"]) for x in lines if x.get("step_s") is not None]
    times = [float(x["time"]) for x in lines]
    cadence = [b - a for a, b in zip(times, times[1:], strict=False)]  # step 1 on: see the module docstring
    out.update(
        eval_before=summary.get("eval_before"),
        eval_after=summary.get("eval_after"),
        eval_after_version=summary.get("eval_after_version"),
        steps=len(lines),
        wall_s=summary.get("wall_s"),
        step_s_mean=statistics.fmean(cadence) if cadence else None,
        step_s_median=statistics.median(cadence) if cadence else None,
        step_s=[round(s, 4) for s in cadence],
        trainer_step_s_mean=statistics.fmean(step_s) if step_s else None,
        trainer_step_s_median=statistics.median(step_s) if step_s else None,
        samples=summary.get("samples_trained", sum(int(x.get("samples", 0)) for x in lines)),
        staleness_mean=summary.get("staleness_mean"),
        trajectories_dropped=summary.get("trajectories_dropped"),
        reward_mean=statistics.fmean(x["reward_mean"] for x in lines if x.get("reward_mean") is not None)
        if lines
        else None,
    )
    if out["steps"] != cfg.trainer.steps:
        out["warning"] = f"metrics.jsonl has {out['steps']} steps, the recipe asks for {cfg.trainer.steps}"
    return out


def run_trl(
    recipe: str, overrides: list[str], work: Path, env: dict[str, str], threads: int | None, timeout_s: float
) -> dict[str, Any]:
    """``benchmarks/trl_grpo.py`` as a subprocess; its result dict, or one with ``error``."""
    result_path = work / "trl.json"
    cmd = [sys.executable, str(HERE / "trl_grpo.py"), "--recipe", recipe, "--out", str(result_path)]
    cmd += [x for o in overrides for x in ("--set", o)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    _log(f"trl: {' '.join(cmd[1:])}")
    proc = run_measured(cmd, env, work / "trl.log", timeout_s)
    if proc["returncode"] != 0 or not result_path.is_file():
        return {
            "framework": "trl",
            **proc,
            "log_tail": tail(work / "trl.log"),
            "error": f"trl_grpo.py exited with status {proc['returncode']}; log: {proc['log']}",
        }
    return {**json.loads(result_path.read_text()), **proc}


def _ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, int | float) or not isinstance(b, int | float) or b == 0:
        return None
    return a / b


def _gain(side: dict[str, Any]) -> float | None:
    before, after = side.get("eval_before"), side.get("eval_after")
    return after - before if isinstance(before, int | float) and isinstance(after, int | float) else None


def compare(miles: dict[str, Any], trl: dict[str, Any]) -> dict[str, Any]:
    """Miles/TRL ratios (below 1: Miles is faster / cheaper) and each side's accuracy gain; none from a failed side."""
    miles, trl = ({} if side.get("error") else side for side in (miles, trl))
    return {
        "step_s_mean_miles_over_trl": _ratio(miles.get("step_s_mean"), trl.get("step_s_mean")),
        "step_s_median_miles_over_trl": _ratio(miles.get("step_s_median"), trl.get("step_s_median")),
        "process_wall_miles_over_trl": _ratio(miles.get("process_wall_s"), trl.get("process_wall_s")),
        "cpu_s_miles_over_trl": _ratio(miles.get("cpu_s"), trl.get("cpu_s")),
        "accuracy_gain_miles": _gain(miles),
        "accuracy_gain_trl": _gain(trl),
    }


def median_ratios(per_pair: list[dict[str, Any]]) -> dict[str, float | None]:
    """Each ratio's median over the pairs that have it (None where no pair does)."""
    out: dict[str, float | None] = {}
    for key in per_pair[0]:
        values = [r[key] for r in per_pair if isinstance(r.get(key), int | float)]
        out[key] = statistics.median(values) if values else None
    return out


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(miles: dict[str, Any], trl: dict[str, Any], ratios: dict[str, Any]) -> str:
    """Side-by-side plain-text table (a failed side's column is blank; its error follows the table)."""
    errors = [f"{side['framework']}: ERROR {side['error']}" for side in (miles, trl) if side.get("error")]
    miles, trl = ({} if side.get("error") else side for side in (miles, trl))
    rows = [
        ("steps", miles.get("steps"), trl.get("steps"), None),
        ("samples trained", miles.get("samples"), trl.get("samples"), None),
        (
            "time per step, mean (s)",
            miles.get("step_s_mean"),
            trl.get("step_s_mean"),
            ratios["step_s_mean_miles_over_trl"],
        ),
        (
            "time per step, median (s)",
            miles.get("step_s_median"),
            trl.get("step_s_median"),
            ratios["step_s_median_miles_over_trl"],
        ),
        (
            "wall, whole process (s)",
            miles.get("process_wall_s"),
            trl.get("process_wall_s"),
            ratios["process_wall_miles_over_trl"],
        ),
        ("wall, as reported (s)", miles.get("wall_s"), trl.get("wall_s"), None),
        ("CPU time, process tree (s)", miles.get("cpu_s"), trl.get("cpu_s"), ratios["cpu_s_miles_over_trl"]),
        ("eval accuracy before", miles.get("eval_before"), trl.get("eval_before"), None),
        ("eval accuracy after", miles.get("eval_after"), trl.get("eval_after"), None),
        ("accuracy gain", ratios["accuracy_gain_miles"], ratios["accuracy_gain_trl"], None),
    ]
    head = f"{'':28} {'Miles':>10} {'TRL':>10} {'Miles/TRL':>10}"
    lines = [head, "-" * len(head)]
    for name, m, t, r in rows:
        lines.append(f"{name:28} {_fmt(m):>10} {_fmt(t):>10} {_fmt(r, 2):>10}")
    return "\n".join(lines + errors)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", required=True, help="Miles recipe, e.g. recipes/quickstart.yaml.")
    add_override_option(p)
    p.add_argument("--out", help="Write the comparison JSON here.")
    p.add_argument(
        "--env-threads",
        type=int,
        default=1,
        help="OMP/MKL/OpenBLAS thread limit in both sides' environment (default 1, as Miles' actors).",
    )
    p.add_argument(
        "--trl-threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch intra-op threads of the TRL process (default: every core this process may use, as Miles' "
        "processes together do).",
    )
    p.add_argument("--only", choices=("miles", "trl"), help="Run one side only (e.g. while the other is broken).")
    p.add_argument(
        "--pairs", type=int, default=1, help="Miles/TRL pairs, interleaved (M T, T M, ...); ratios: median of pairs."
    )
    p.add_argument("--timeout-s", type=float, default=3600.0, help="Per-side time limit.")
    p.add_argument("--keep", action="store_true", help="Keep the work directory (Miles run dir, logs).")
    args = p.parse_args(argv)
    if args.pairs < 1:
        print("miles_vs_trl: error: --pairs must be at least 1", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as exc:
        print(f"miles_vs_trl: error: {exc}", file=sys.stderr)
        return 2

    from miles.prepare import prepare_model

    start = time.perf_counter()
    model_dir = prepare_model(cfg)  # build once, outside both measurements
    _log(f"model ready in {time.perf_counter() - start:.1f}s: {model_dir}")

    env = child_env(args.env_threads)
    work = Path(tempfile.mkdtemp(prefix="miles-vs-trl-"))
    skipped = {"error": "skipped (--only)"}
    pairs: list[dict[str, Any]] = []
    for index in range(args.pairs):
        miles = {"framework": "miles", **skipped}
        trl = {"framework": "trl", **skipped}
        order = ("miles", "trl") if index % 2 == 0 else ("trl", "miles")  # alternate who runs first
        for side in order:
            if args.only not in (None, side):
                continue
            pair_dir = work / f"pair{index}"
            pair_dir.mkdir(parents=True, exist_ok=True)
            if side == "miles":
                miles = run_miles(args.recipe, args.overrides, cfg, pair_dir, env, args.timeout_s)
                if miles.get("error"):
                    _log(f"MILES FAILED: {miles['error']}\n{miles.get('log_tail', '')}")
            else:
                trl = run_trl(args.recipe, args.overrides, pair_dir, env, args.trl_threads, args.timeout_s)
                if trl.get("error"):
                    _log(f"TRL FAILED: {trl['error']}\n{trl.get('log_tail', '')}")
        ratios = compare(miles, trl)
        print(f"pair {index + 1} of {args.pairs} ({' then '.join(order)}):")
        print(table(miles, trl, ratios))
        pairs.append({"order": list(order), "miles": miles, "trl": trl, "ratios": ratios})

    ratios = median_ratios([p["ratios"] for p in pairs])
    if args.pairs > 1:
        print(f"median over {args.pairs} pairs: " + ", ".join(f"{k} {_fmt(v, 3)}" for k, v in ratios.items()))
    result = {
        "recipe": args.recipe,
        "overrides": args.overrides,
        "budget": {
            "steps": cfg.trainer.steps,
            "groups_per_step": cfg.trainer.groups_per_step,
            "group_size": cfg.rollout.group_size,
            "max_new_tokens": cfg.rollout.sampling.max_new_tokens,
        },
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "env_threads": {name: env[name] for name in THREAD_ENV},
        "pairs": pairs,
        "ratios": ratios,  # the median over pairs of each pair's ratio
        "work_dir": str(work),
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        _log(f"wrote {args.out}")
    sides = [p[side] for p in pairs for side in ("miles", "trl")]
    failed = any(s.get("error") and s["error"] != skipped["error"] for s in sides)
    if args.keep or failed:  # a failure's logs are what the error message points at
        _log(f"work directory kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
