"""A long run of fast steps: controller memory, restart time and stream sizes must stay flat.

    python benchmarks/soak.py --steps 20000 --every 1000 --restart-every 5000 --out benchmarks/results/soak.json

The quickstart's task and tiny model with small steps (``--groups-per-step`` groups of 4), run as separate
``miles-node`` processes (a controller, one rollout worker, one trainer rank) on an embedded nats-server, with
the defaults under test: ``bus.retention: recovery``, a controller snapshot every ``bus.snapshot_every_steps``
(50) steps, a checkpoint every ``--checkpoint-every`` steps. Every ``--every`` recorded steps the script
samples the controller's resident memory and the bytes and messages of TRAJ, EVENTS and METRICS; every
``--restart-every`` steps it then SIGKILLs the controller and starts it again, and the restart's rebuild
seconds come from its ``controller_rebuilt`` log line. The run must complete with every step recorded once and
nothing refused. Rows go to ``--out`` (small: one per sample) and a markdown table to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nats
import psutil

from miles.bus.server import EmbeddedNats
from miles.bus.subjects import Subjects
from miles.config import RunConfig, dump_config, load_config
from miles.launch import node_command
from miles.ports import free_port
from miles.prepare import prepare

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "quickstart.yaml"


def soak_config(args: argparse.Namespace) -> RunConfig:
    sets = {
        "name": "soak",
        "trainer.steps": args.steps,
        "trainer.groups_per_step": args.groups_per_step,
        "rollout.groups_in_flight": args.groups_per_step,
        "rollout.group_size": 4,
        "rollout.engine.max_batch": 4 * args.groups_per_step,
        "trainer.checkpoint_every": args.checkpoint_every,
        "eval.every": args.steps,  # the first and the last evaluation only
        "monitor.plots": False,
    }
    return load_config(str(RECIPE), [f"{key}={value}" for key, value in sets.items()])


class Soak:
    def __init__(self, cfg: RunConfig, run_dir: Path, url: str) -> None:
        self.cfg, self.run_dir, self.url = cfg, run_dir, url
        run_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = run_dir / "config.yaml"
        self.config_path.write_text(dump_config(cfg))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.controller_lives = 0

    def start(self, name: str, role: str, *extra: str) -> None:
        with open(self.run_dir / f"{name}.log", "ab") as log:
            cmd = node_command(role, self.config_path, self.run_dir, self.url, *extra)
            env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def start_controller(self) -> str:
        name = f"controller-{self.controller_lives}"
        self.controller_lives += 1
        self.start(name, "controller", "--actor-id", "controller")
        return name

    def steps_recorded(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return sum(1 for _ in path.open()) if path.exists() else 0

    def rebuilt(self, name: str, timeout_s: float = 120) -> dict[str, Any]:
        """The restarted controller's ``controller_rebuilt`` line (waits for it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in (self.run_dir / f"{name}.log").read_text().splitlines():
                if '"controller_rebuilt"' in line:
                    return json.loads(line)
            time.sleep(0.2)
        raise RuntimeError(f"{name} did not rebuild within {timeout_s} s")


async def stream_sizes(url: str, run: str) -> dict[str, dict[str, int]]:
    nc = await nats.connect(url)
    try:
        js, s = nc.jetstream(), Subjects(run)
        out = {}
        for stream in (s.traj_stream, s.events_stream, s.metrics_stream, s.snapshot_stream):
            state = (await js.stream_info(stream)).state
            out[stream.rsplit("_", 1)[-1]] = {"bytes": state.bytes, "messages": state.messages}
        return out
    finally:
        await nc.close()


def run(args: argparse.Namespace, root: Path) -> list[dict[str, Any]]:
    cfg = soak_config(args)
    prepare(cfg)
    rows: list[dict[str, Any]] = []
    with EmbeddedNats(root / "bus") as server:
        soak = Soak(cfg, root / "run", server.url)
        controller = soak.start_controller()
        soak.start("rollout-0", "rollout", "--actor-id", "rollout-0")
        rank = ("--rank", "0", "--world-size", "1", "--master-port", str(free_port()))
        soak.start("trainer-0", "trainer", "--actor-id", "trainer-0", *rank)
        started = time.monotonic()
        try:
            for target in range(args.every, args.steps, args.every):
                while soak.steps_recorded() < target:
                    for name, proc in soak.procs.items():
                        if proc.poll() is not None and not name.startswith("controller"):
                            raise RuntimeError(f"{name} exited {proc.returncode}: see {soak.run_dir / name}.log")
                    time.sleep(1.0)
                rss = psutil.Process(soak.procs[controller].pid).memory_info().rss
                sizes = asyncio.run(stream_sizes(server.url, cfg.name))
                row: dict[str, Any] = {
                    "steps": soak.steps_recorded(),
                    "elapsed_s": round(time.monotonic() - started, 1),
                    "controller_life": soak.controller_lives,
                    "controller_rss_mb": round(rss / 2**20, 1),
                    **{f"{stream}_{key}": value for stream, size in sizes.items() for key, value in size.items()},
                }
                if target % args.restart_every == 0:
                    soak.procs[controller].send_signal(signal.SIGKILL)
                    soak.procs[controller].wait(timeout=30)
                    controller = soak.start_controller()
                    rebuilt = soak.rebuilt(controller)
                    row |= {
                        "restart_rebuild_s": rebuilt["seconds"],
                        "restart_replayed": rebuilt["replayed"],
                        "restart_from_snapshot_step": rebuilt["snapshot_step"],
                    }
                rows.append(row)
                print(json.dumps(row), flush=True)
            deadline = time.monotonic() + 600
            while not (soak.run_dir / "summary.json").exists() and time.monotonic() < deadline:
                time.sleep(1.0)
            for proc in soak.procs.values():
                if proc.poll() is None:
                    proc.wait(timeout=120)
        finally:
            for proc in soak.procs.values():
                if proc.poll() is None:
                    proc.kill()
        summary = json.loads((soak.run_dir / "summary.json").read_text())
        steps = sorted(json.loads(line)["step"] for line in (soak.run_dir / "metrics.jsonl").open())
        if summary["status"] != "complete" or steps != list(range(args.steps)) or summary["refused"]:
            raise RuntimeError(f"the soak run is not exact: {summary['status']}, refused {summary['refused']}")
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| steps | controller (life) RSS MB | then restarted: rebuild s (replayed messages) | TRAJ MB (msgs) | "
        "EVENTS kB (msgs) | METRICS kB (msgs) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        restart = f"{r['restart_rebuild_s']:.3f} ({r['restart_replayed']})" if "restart_rebuild_s" in r else ""
        lines.append(
            f"| {r['steps']:,} | ({r['controller_life']}) {r['controller_rss_mb']} | {restart} | "
            f"{r['TRAJ_bytes'] / 1e6:.1f} ({r['TRAJ_messages']:,}) | {r['EVENTS_bytes'] / 1e3:.0f} "
            f"({r['EVENTS_messages']:,}) | {r['METRICS_bytes'] / 1e3:.0f} ({r['METRICS_messages']:,}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20000, help="Steps of the run (default 20000).")
    p.add_argument("--every", type=int, default=1000, help="Sample every this many steps (default 1000).")
    p.add_argument(
        "--restart-every", type=int, default=5000, help="Restart the controller every this many steps (default 5000)."
    )
    p.add_argument("--groups-per-step", type=int, default=4, help="Groups of 4 episodes per step (default 4).")
    p.add_argument("--checkpoint-every", type=int, default=100, help="Trainer checkpoint interval (default 100).")
    p.add_argument("--out", help="Write the rows as JSON here.")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        rows = run(args, Path(tmp))
    text = markdown(rows)
    print(text)
    if args.out:
        result = {
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "rows": rows,
            "markdown": text,
            "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
