"""Where a Miles step goes: CPU per process and a sampled profile of the trainer, over one `miles run`.

    python benchmarks/step_profile.py --recipe recipes/quickstart.yaml --set trainer.steps=300 \\
        --out benchmarks/results/step_profile.json

Runs ``miles run RECIPE`` (same environment as ``benchmarks/miles_vs_trl.py``: ``OMP_NUM_THREADS=1``) and
meanwhile

* samples every process of the run (launcher, nats-server, controller, each rollout worker, each trainer rank)
  every ``--sample-s`` with psutil: CPU seconds (user + system) inside the training window, i.e. from the
  first to the last step record in ``metrics.jsonl`` (start-up and the final evaluation left out), per role
  and as cores used (CPU seconds / window seconds);
* attaches ``py-spy record --idle --threads --nonblocking --format raw`` to trainer rank 0 (unless
  ``--no-py-spy``) for the training window and sorts its samples per thread into what the trainer was
  doing: on the torch thread the update (``RankWorker.train``), the weight export (``export_params``),
  the checkpoint (``save_checkpoint`` / ``poll_checkpoint``) or nothing; on the event-loop thread
  collecting trajectories (``_collect``), publishing (``_publish``: the streamed export feeding the data
  plane, the announcement), acking and reporting (``_step`` after the publish), or waiting (idle in the
  loop); DCP's background checkpoint writer separately. With ``--nonblocking`` py-spy never stops the
  process; a sample is one instant of one thread, so ``samples / rate`` estimates seconds. A thread that is
  runnable but waiting for a core counts as busy, so on a loaded machine "busy" exceeds CPU seconds.

Per step, from ``metrics.jsonl``: the cadence (interval between consecutive step records: the true time per
step) and the trainer's ``step_s``; from the trainer's log, checkpoint seconds (save call to durable) and
data-plane put seconds. The 1-minute load average before and after is recorded: on a shared machine, read
the cores-used figures with it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

# (category, substrings of a frame "function (file:line)"), checked innermost frame first, first match wins.
TRAINER_RULES = {
    "trainer-torch": (
        ("checkpoint", ("RankWorker.save_checkpoint", "RankWorker.poll_checkpoint")),
        ("export", ("export_params", "export_stream", "iter_full_params")),
        ("update: all-reduce", ("FsdpBackend.all_reduce",)),
        ("update: pack micro-batches", ("RLStep._micro_batches",)),
        ("update: proximal log-probs (no grad)", ("FsdpBackend.score",)),
        ("update: forward", ("FsdpBackend._forward",)),
        ("update: backward", ("Tensor.backward",)),
        ("update: optimizer", ("FsdpBackend.optimizer_step",)),
        ("update: other", ("RankWorker.train ",)),
    ),
    "MainThread": (
        ("collect trajectories", ("TrainerLeader._collect ",)),
        ("publish weights", ("TrainerLeader._publish ",)),
        ("ack, report, checkpoint call", ("TrainerLeader._step ",)),
    ),
}
ROLLOUT_RULES = {
    "torch-engine-loop": (
        ("prefill", ("SamplingLoop.prefill",)),
        ("decode forward", ("SamplingLoop._forward",)),
        ("sample", ("SamplingLoop.sample",)),
        ("retire / admit / merge", ("SamplingLoop.retire", "SamplingLoop.admit", "SamplingLoop.merge")),
        ("weights", ("stage", "copy_into", "WeightSlot")),
    ),
    "MainThread": (
        ("weights: fetch and decode", ("WeightFollower", "WeightStore")),
        ("evaluation", ("RolloutWorker._evaluate",)),
        ("episodes", ("run_episode",)),
        ("trajectory: build and publish", ("RolloutWorker._play_group",)),
        ("prompts", ("RolloutWorker._prompt_loop",)),
    ),
    "asyncio_": (("reward", ("reward",)),),
}
# Innermost frames of a thread with nothing to do: the event loop between callbacks, an executor's idle worker,
# any blocking wait.
IDLE_FRAMES = (
    "Runner.run (asyncio/runners.py",
    "_worker (concurrent/futures/thread.py:81)",
    "wait (threading.py",
    "select",
    "epoll",
)


def role_of(proc: psutil.Process) -> str:
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return "?"
    if cmd and cmd[0].endswith("nats-server"):
        return "nats-server"
    if "--actor-id" in cmd:
        return cmd[cmd.index("--actor-id") + 1]
    if "miles.cli" in cmd:
        return "launcher"
    return Path(cmd[0]).name if cmd else "?"


class CpuSampler:
    """Samples the CPU seconds of every process under ``root`` (by role) every ``every_s``."""

    def __init__(self, root: int, every_s: float) -> None:
        self.root = psutil.Process(root)
        self.every_s = every_s
        self.series: list[tuple[float, dict[str, float]]] = []  # (time.time(), {role: cpu s so far})
        self.pids: dict[int, tuple[str, psutil.Process]] = {}
        self.last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            procs = []
        for proc in procs:
            if proc.pid not in self.pids:
                self.pids[proc.pid] = (role_of(proc), proc)
            try:
                t = proc.cpu_times()
                self.last[proc.pid] = t.user + t.system
            except psutil.Error:
                pass  # gone: its last sample stands
        by_role: dict[str, float] = collections.defaultdict(float)
        for pid, cpu in self.last.items():
            by_role[self.pids[pid][0]] += cpu
        self.series.append((time.time(), dict(by_role)))

    def pid_of(self, role: str) -> int | None:
        self.sample()
        for pid, (name, _) in self.pids.items():
            if name == role:
                return pid
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, when: float) -> dict[str, float]:
        """CPU seconds per role at the last sample not after ``when``."""
        best: dict[str, float] = {}
        for t, roles in self.series:
            if t > when:
                break
            best = roles
        return best


def categorize(raw: Path, rate: float, rules: dict[str, tuple[tuple[str, tuple[str, ...]], ...]]) -> dict[str, Any]:
    """Seconds per thread and activity from a py-spy raw file (``frame;frame;... count``, outermost first).

    ``rules`` maps a substring of the thread's name to its (activity, frame substrings) rules, checked in
    order; a busy sample no rule matches is "other"."""
    threads: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        thread, body = frames[0], frames[1:]
        joined = ";".join(body)
        name = next((label for label in rules if label in thread), None)
        if name is None:
            name = "checkpoint writer" if "torch/distributed/checkpoint" in joined else "other threads"
        category = "idle" if not body or _is_idle(body[-1]) else "other"
        if category != "idle":
            for label, needles in rules.get(name, ()):
                if any(n in joined for n in needles):
                    category = label
                    break
        threads[name][category] += int(count)
    return {name: {k: round(v / rate, 2) for k, v in c.most_common()} for name, c in threads.items()}


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _is_idle(frame: str) -> bool:
    return any(word in frame for word in IDLE_FRAMES)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--sample-s", type=float, default=0.5)
    p.add_argument("--rate", type=float, default=100.0, help="py-spy samples per second")
    p.add_argument("--no-py-spy", action="store_true")
    p.add_argument("--py-spy-roles", default="trainer-0,rollout-0", help="actor ids to profile, comma-separated")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--keep", action="store_true", help="keep the run directory")
    args = p.parse_args()

    from miles.config import load_config

    steps = load_config(args.recipe, args.overrides).trainer.steps
    work = Path(tempfile.mkdtemp(prefix="miles-step-profile-"))
    run_dir = work / "run"
    cmd = [sys.executable, "-m", "miles.cli", "run", args.recipe, "--run-dir", str(run_dir), "--quiet"]
    cmd += [x for o in args.overrides for x in ("--set", o)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.update(TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    load_before = os.getloadavg()[0]
    log = open(work / "miles.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    sampler = CpuSampler(proc.pid, args.sample_s)
    spies: list[subprocess.Popen[bytes]] = []
    roles = [r for r in args.py_spy_roles.split(",") if r] if not args.no_py_spy else []
    try:
        if roles:
            # Only the training window: from the first step record to the last one.
            metrics = run_dir / "metrics.jsonl"
            while proc.poll() is None and _lines(metrics) < 1:
                time.sleep(0.05)
            for role in roles:
                pid = sampler.pid_of(role)
                if pid is None or proc.poll() is not None:
                    continue
                spy_cmd = [shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"), "record"]
                spy_cmd += ["--pid", str(pid), "--rate", str(int(args.rate)), "--format", "raw"]
                spy_cmd += ["-o", str(work / f"{role}.pyspy.txt"), "--idle", "--threads", "--nonblocking"]
                err = open(work / f"{role}.py-spy.log", "wb")
                spies.append(subprocess.Popen(spy_cmd, stdout=subprocess.DEVNULL, stderr=err))
            while proc.poll() is None and _lines(metrics) < steps:
                time.sleep(0.05)
            for spy in spies:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        status = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        proc.wait()
        raise
    finally:
        sampler.sample()
        sampler.close()
        log.close()
    for spy in spies:
        try:
            spy.wait(timeout=60)
        except subprocess.TimeoutExpired:
            spy.send_signal(signal.SIGINT)
            spy.wait()
    if status != 0:
        print((work / "miles.log").read_text(errors="replace")[-3000:], file=sys.stderr)
        print(f"miles run exited with status {status}; kept {work}", file=sys.stderr)
        return 1

    started_at = float((run_dir / "started_at").read_text())
    rows = sorted(
        (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()),
        key=lambda r: r["step"],
    )
    t0, t1 = started_at + rows[0]["time"], started_at + rows[-1]["time"]
    window = t1 - t0
    cpu0, cpu1 = sampler.at(t0), sampler.at(t1)
    cpu = {role: round(cpu1.get(role, 0.0) - cpu0.get(role, 0.0), 2) for role in sorted(cpu1)}
    cadence = [b["time"] - a["time"] for a, b in zip(rows, rows[1:], strict=False)]
    step_s = [r["step_s"] for r in rows[1:]]
    trainer_log = (run_dir / "logs" / "trainer-0.log").read_text(errors="replace").splitlines()
    ckpt = [json.loads(x)["seconds"] for x in trainer_log if '"checkpoint.complete"' in x]
    puts = [json.loads(x)["seconds"] for x in trainer_log if '"weights_put"' in x]
    summary = json.loads((run_dir / "summary.json").read_text())
    result: dict[str, Any] = {
        "command": "python benchmarks/step_profile.py " + " ".join(sys.argv[1:]),
        "recipe": args.recipe,
        "overrides": args.overrides,
        "steps": len(rows),
        "window_s": round(window, 2),
        "cadence_s_mean": statistics.fmean(cadence),
        "cadence_s_median": statistics.median(cadence),
        "trainer_step_s_mean": statistics.fmean(step_s),
        "trainer_step_s_median": statistics.median(step_s),
        "checkpoints": len(ckpt),
        "checkpoint_s_median": statistics.median(ckpt) if ckpt else None,
        "weights_put_s_median": statistics.median(puts) if puts else None,
        "cpu_s_in_window": cpu,
        "cpu_s_in_window_total": round(sum(cpu.values()), 2),
        "cores_used_in_window": {role: round(v / window, 3) for role, v in cpu.items()},
        "cpu_s_per_step": {role: round(v / max(1, len(rows) - 1), 4) for role, v in cpu.items()},
        "eval_before": summary.get("eval_before"),
        "eval_after": summary.get("eval_after"),
        "loadavg_1m_before": round(load_before, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }
    per_step = max(1, len(rows) - 1)
    result["py_spy_rate"] = args.rate
    for role in roles:
        raw = work / f"{role}.pyspy.txt"
        if not raw.is_file():
            result[f"{role}_py_spy"] = "no samples (py-spy failed: see its log)"
            continue
        rules = TRAINER_RULES if role.startswith("trainer") else ROLLOUT_RULES if role.startswith("rollout") else {}
        seconds = categorize(raw, args.rate, rules)
        result[f"{role}_ms_per_step_by_thread"] = {
            thread: {k: round(1000 * v / per_step, 1) for k, v in cats.items()} for thread, cats in seconds.items()
        }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if args.keep:
        print(f"kept {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
