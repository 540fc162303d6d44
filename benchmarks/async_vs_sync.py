"""Async vs sync rollouts: eta = 0 against eta = 2 and 4 on long-tailed generation lengths, same sample budget.

    python benchmarks/async_vs_sync.py --out benchmarks/results/async_vs_sync.json

Quick check (all five runs, 4 steps each):

    python benchmarks/async_vs_sync.py --set trainer.steps=4 --out /tmp/avs.json

Runs ``miles run recipes/async-longtail.yaml`` as subprocesses, one at a time (never concurrently, so no
run steals another's cores):

1. long-tailed: the recipe's ``copy`` task (string lengths log-normal; completion length p99 / median
   ~9.5, printed from the train split before the runs) with ``staleness.max_staleness`` 0, 2, 4;
2. uniform: the same task with every string of one length (``task.sigma=0``,
   ``task.median_len=--uniform-len``, chosen so that the mean completion length is about the same as
   the long-tailed task's), eta 0 and 2. Its warm-up is checked every step at a third of the rate: one
   length is learnt fast, and at the defaults the base started at accuracy 1.0 (every group without
   signal, ~93 of 100 steps skipped). A run whose base scores >= 0.9 is reported as an error.

Every run has the same sample budget (the recipe's ``trainer.steps x groups_per_step x group_size``).
From each run's ``summary.json`` and ``metrics.jsonl``: ``wall_s`` (the controller's, start to summary,
the before/after evaluations included), trained samples / wall, trained tokens / wall, eval before and
after (greedy held-out exact match), staleness mean and max. Also, from the trainer's step log, the
*training window* (first to last optimizer step, start-up and the two evaluations excluded) and
samples/s over it, which is the number the overlap of generation and training changes.

While a run goes, a sampler reads the CPU time of every process of its tree (controller, rollout
workers, trainer, nats-server) every ``--sample-s`` seconds; the JSON has each role's CPU seconds and
its busy fraction (CPU seconds / seconds) over the training window, plus the whole tree's cores in use.
On a machine with few cores this is what bounds the speed-up: asynchrony can only fill cores that the
synchronous schedule leaves idle.

The tiny models (one per task variant) are built before the timed runs, so no run pays the build.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from miles.config import ConfigError, add_override_option, load_config

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_RECIPE = "recipes/async-longtail.yaml"
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
NOTHING_TO_LEARN = 0.9  # a base at or above this held-out accuracy gives GRPO groups without reward variance


def _log(msg: str) -> None:
    print(f"[async_vs_sync] {msg}", file=sys.stderr, flush=True)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({name: "1" for name in THREAD_ENV})
    env.update(TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    return env


def _role(proc: psutil.Process) -> str:
    """``controller``, ``rollout-0``, ``trainer-0``, ``nats-server`` or ``launcher`` from a command line."""
    try:
        cmd = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"
    if "--actor-id" in cmd:
        return cmd[cmd.index("--actor-id") + 1]
    if "--role" in cmd:
        return cmd[cmd.index("--role") + 1]
    if cmd and "nats-server" in Path(cmd[0]).name:
        return "nats-server"
    return "launcher" if "miles.cli" in cmd else Path(cmd[0]).name if cmd else "?"


class CpuSampler(threading.Thread):
    """Every ``period`` seconds: (unix time, {role: cumulative CPU seconds}) of a process tree."""

    def __init__(self, pid: int, period: float) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.period = period
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._halt = threading.Event()
        self._roles: dict[int, str] = {}
        self._last: dict[int, float] = {}  # cumulative CPU of every pid ever seen (kept after it exits)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            for proc in procs:
                try:
                    times = proc.cpu_times()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                if proc.pid not in self._roles:
                    self._roles[proc.pid] = _role(proc)
                self._last[proc.pid] = times.user + times.system
            per_role: dict[str, float] = {}
            for pid, cpu in self._last.items():
                role = self._roles[pid]
                per_role[role] = per_role.get(role, 0.0) + cpu
            self.samples.append((time.time(), per_role))
            self._halt.wait(self.period)

    def window(self, start: float, end: float) -> dict[str, Any]:
        """CPU seconds per role between the samples nearest to ``start`` and ``end``, and busy fractions."""
        if len(self.samples) < 2 or end <= start:
            return {}
        first = min(self.samples, key=lambda s: abs(s[0] - start))
        last = min(self.samples, key=lambda s: abs(s[0] - end))
        span = last[0] - first[0]
        if span <= 0:
            return {}
        cpu = {role: round(last[1].get(role, 0.0) - first[1].get(role, 0.0), 2) for role in last[1]}
        busy = {role: round(c / span, 3) for role, c in cpu.items()}
        return {
            "window_s": round(span, 2),
            "cpu_s": cpu,
            "busy": busy,
            "cores_in_use": round(sum(cpu.values()) / span, 3),
        }


def _iso(ts: str) -> float:
    return dt.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def step_times(run_dir: Path) -> list[float]:
    """Unix times of the trainer's optimizer steps (its structured log)."""
    out: list[float] = []
    log = run_dir / "logs" / "trainer-0.log"
    if not log.is_file():
        return out
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("event") == "step" and "timestamp" in rec:
            out.append(_iso(rec["timestamp"]))
    return out


def run_one(
    label: str, recipe: str, overrides: list[str], work: Path, env: dict[str, str], period: float, timeout_s: float
) -> dict[str, Any]:
    run_dir = work / label
    cmd = [sys.executable, "-m", "miles.cli", "run", recipe, "--run-dir", str(run_dir), "--quiet"]
    cmd += [x for o in overrides for x in ("--set", o)]
    _log(f"{label}: {' '.join(cmd[1:])}")
    log_path = work / f"{label}.log"
    load = os.getloadavg()[0]  # other work on the machine shares its cores: recorded, not controlled
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        sampler = CpuSampler(proc.pid, period)
        sampler.start()
        try:
            status = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(2)  # SIGINT: the launcher stops its actors
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            status = 124
        sampler.stop()
    out: dict[str, Any] = {
        "label": label,
        "overrides": overrides,
        "returncode": status,
        "process_wall_s": round(time.perf_counter() - start, 2),
        "loadavg_1m_before": round(load, 2),
        "log": str(log_path),
        "run_dir": str(run_dir),
    }
    summary_path = run_dir / "summary.json"
    if status != 0 or not summary_path.is_file():
        out["error"] = f"miles run exited with status {status}; log: {log_path}"
        return out
    summary = json.loads(summary_path.read_text())
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    samples = int(summary.get("samples_trained") or sum(int(m.get("samples", 0)) for m in metrics))
    # Completion tokens (what generation and the update cost grow with): each step's mean length x episodes.
    tokens = sum(float(m.get("length_mean", 0)) * float(m.get("episodes", 0)) for m in metrics)
    seqs = sum(float(m.get("episodes", 0)) for m in metrics)
    wall = float(summary["wall_s"])
    steps = step_times(run_dir)
    train_window = steps[-1] - steps[0] if len(steps) >= 2 else None
    # Samples trained over the window between the first and the last step: every step but the first.
    window_samples = samples * (len(steps) - 1) / len(steps) if len(steps) >= 2 else None
    step_s = [float(m["step_s"]) for m in metrics if m.get("step_s") is not None]
    out.update(
        eval_before=summary.get("eval_before"),
        eval_after=summary.get("eval_after"),
        wall_s=wall,
        steps=len(metrics),
        samples_trained=samples,
        tokens_trained=int(tokens),
        completion_len_mean=round(tokens / seqs, 2) if seqs else None,
        samples_per_s=round(samples / wall, 2),
        tokens_per_s=round(tokens / wall, 1),
        train_window_s=round(train_window, 2) if train_window else None,
        train_samples_per_s=round(window_samples / train_window, 2) if train_window else None,
        step_s_median=round(statistics.median(step_s), 4) if step_s else None,
        staleness_mean=summary.get("staleness_mean"),
        staleness_max=summary.get("staleness_max"),
        trajectories_dropped=summary.get("trajectories_dropped"),
        trajectories_requeued=summary.get("trajectories_requeued"),
        reward_mean=round(statistics.fmean(m["reward_mean"] for m in metrics if m.get("reward_mean") is not None), 4)
        if metrics
        else None,
        cpu_train_window=sampler.window(steps[0], steps[-1]) if len(steps) >= 2 else {},
    )
    return out


def add_ratios(runs: list[dict[str, Any]]) -> None:
    """Throughput and wall ratios of every run against the eta = 0 run of the same task."""
    base = {r["task"]: r for r in runs if r["eta"] == 0 and not r.get("error")}
    for r in runs:
        b = base.get(r["task"])
        if r.get("error") or b is None:
            continue
        r["samples_per_s_vs_eta0"] = round(r["samples_per_s"] / b["samples_per_s"], 3)
        r["wall_speedup_vs_eta0"] = round(b["wall_s"] / r["wall_s"], 3)
        if r.get("train_samples_per_s") and b.get("train_samples_per_s"):
            r["train_samples_per_s_vs_eta0"] = round(r["train_samples_per_s"] / b["train_samples_per_s"], 3)


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(runs: list[dict[str, Any]]) -> str:
    head = (
        "| task | eta | wall s | samples/s | x eta=0 | train-window samples/s | x eta=0 | tokens/s "
        "| eval before -> after | staleness mean / max | cores in use (trainer, rollouts) |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in runs:
        if r.get("error"):
            lines.append(f"| {r['task']} | {r['eta']} | ERROR: {r['error']} |" + " |" * 8)
            continue
        cpu = r.get("cpu_train_window") or {}
        busy = cpu.get("busy", {})
        rollouts = sum(v for k, v in busy.items() if k.startswith("rollout"))
        cores = (
            f"{cpu['cores_in_use']:.2f} ({busy.get('trainer-0', 0):.2f}, {rollouts:.2f})"
            if "cores_in_use" in cpu
            else "-"
        )
        lines.append(
            f"| {r['task']} | {r['eta']} | {r['wall_s']:.1f} | {r['samples_per_s']:.1f} "
            f"| {_f(r.get('samples_per_s_vs_eta0'), '.2f')} | {_f(r.get('train_samples_per_s'), '.1f')} "
            f"| {_f(r.get('train_samples_per_s_vs_eta0'), '.2f')} | {r['tokens_per_s']:.0f} "
            f"| {r['eval_before']:.3f} -> {r['eval_after']:.3f} "
            f"| {r['staleness_mean']:.2f} / {r['staleness_max']} | {cores} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"Long-tailed recipe (default {DEFAULT_RECIPE}).")
    add_override_option(p)
    p.add_argument("--etas", default="0,2,4", help="max_staleness values on the long-tailed task.")
    p.add_argument("--uniform-etas", default="0,2", help="max_staleness values on the uniform task ('' to skip).")
    p.add_argument("--uniform-len", type=int, default=9, help="String length of the uniform-length task.")
    p.add_argument("--sample-s", type=float, default=0.5, help="CPU sampling period.")
    p.add_argument("--timeout-s", type=float, default=900.0, help="Per-run time limit.")
    p.add_argument("--out", help="Write the results JSON here.")
    args = p.parse_args(argv)

    # One string length is learnt within a few warm-up steps: checked every step at a lower rate, the
    # warm-up stops with something left for RL to learn (at the default it stopped at accuracy 1.0).
    uniform = [
        "task.sigma=0",
        f"task.median_len={args.uniform_len}",
        "model.warmup_check_every=1",
        "model.warmup_lr=1e-3",
    ]
    variants = [("long-tailed", [], [int(x) for x in args.etas.split(",") if x.strip()])]
    if args.uniform_etas.strip():
        variants.append(("uniform", uniform, [int(x) for x in args.uniform_etas.split(",") if x.strip()]))

    from miles.prepare import prepare_model
    from miles.tasks.registry import build_task

    tasks: dict[str, Any] = {}
    for name, extra, _ in variants:
        try:
            cfg = load_config(ROOT / args.recipe, [*args.overrides, *extra])
        except ConfigError as exc:
            print(f"async_vs_sync: error: {exc}", file=sys.stderr)
            return 2
        info: dict[str, Any] = {"overrides": extra}
        if cfg.task.type == "copy":
            from miles.tasks.copy import length_stats

            info["train_completion_len"] = length_stats(build_task(cfg.task).samples("train"))
            _log(f"{name}: train completion lengths {info['train_completion_len']}")
        t0 = time.perf_counter()
        info["model_dir"] = str(prepare_model(cfg))  # built here, outside the timings
        _log(f"{name}: model ready in {time.perf_counter() - t0:.1f}s")
        info["budget"] = {
            "steps": cfg.trainer.steps,
            "groups_per_step": cfg.trainer.groups_per_step,
            "group_size": cfg.rollout.group_size,
            "samples": cfg.trainer.steps * cfg.trainer.groups_per_step * cfg.rollout.group_size,
            "rollout_workers": cfg.rollout.workers,
            "groups_in_flight": cfg.rollout.groups_in_flight,
        }
        tasks[name] = info

    env = child_env()
    work = Path(tempfile.mkdtemp(prefix="async-vs-sync-"))
    runs: list[dict[str, Any]] = []
    failed = False
    for name, extra, etas in variants:
        for eta in etas:
            r = run_one(
                f"{name}-eta{eta}",
                args.recipe,
                [*args.overrides, *extra, f"staleness.max_staleness={eta}"],
                work,
                env,
                args.sample_s,
                args.timeout_s,
            )
            r.update(task=name, eta=eta)
            if not r.get("error") and (r.get("eval_before") or 0.0) >= NOTHING_TO_LEARN:
                r["error"] = (
                    f"the base already scores {r['eval_before']} held-out: no signal to learn from, so the run "
                    "measures skipped steps, not training (lower the warm-up's target or rate)"
                )
            if r.get("error"):
                failed = True
                _log(f"FAILED: {r['error']}")
            else:
                _log(
                    f"{r['label']}: wall {r['wall_s']}s, {r['samples_per_s']} samples/s, "
                    f"eval {r['eval_before']} -> {r['eval_after']}, staleness {r['staleness_mean']:.2f}/"
                    f"{r['staleness_max']}, cores in use {r['cpu_train_window'].get('cores_in_use')}"
                )
            runs.append(r)
    add_ratios(runs)
    print(table(runs))
    result = {
        "recipe": args.recipe,
        "overrides": args.overrides,
        "tasks": tasks,
        "runs": runs,
        "machine": {
            "cpus": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "work_dir": str(work),
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        _log(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
