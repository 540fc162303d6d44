"""``miles run``: every actor of a run as local processes, on an embedded (or given) NATS server.

The launcher is only a process supervisor plus a progress view: the actors are the same
``miles-node`` processes one would start by hand on many machines, and they talk only over the
bus. The run ends when the controller exits; a crashed actor ends it with a non-zero status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from miles.child_process import die_with_parent
from miles.config import RunConfig, dump_config
from miles.ports import free_port

if TYPE_CHECKING:
    from miles.progress import ProgressView

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path


def node_command(role: str, config_path: Path, run_dir: Path, nats_url: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "miles.node",
        "--role",
        role,
        "--config",
        str(config_path),
        "--run-dir",
        str(run_dir),
        "--nats-url",
        nats_url,
        *extra,
    ]


def _spawn(name: str, cmd: list[str], run_dir: Path) -> Child:
    log_path = run_dir / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"
    )
    handle = open(log_path, "ab")
    proc = subprocess.Popen(
        cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True, **die_with_parent()
    )
    handle.close()
    return Child(name, proc, log_path)


def spawn_actors(
    cfg: RunConfig, config_path: Path, run_dir: Path, nats_url: str, gpus: dict[str, int] | None = None
) -> list[Child]:
    """Controller, rollout workers and trainer ranks as separate OS processes; a rollout worker in ``gpus``
    (:func:`gpu_plan`) is told its GPU (trainer rank ``r`` takes GPU ``r`` itself)."""
    gpus = gpus or {}
    children = [
        _spawn(
            "controller",
            node_command("controller", config_path, run_dir, nats_url, "--actor-id", "controller"),
            run_dir,
        )
    ]
    for i in range(cfg.rollout.workers):
        rank = ["--weight-group-rank", str(i + 1)] if cfg.sync.transport == "broadcast" else []
        gpu = ["--gpu", str(gpus[f"rollout-{i}"])] if f"rollout-{i}" in gpus else []
        cmd = node_command("rollout", config_path, run_dir, nats_url, "--actor-id", f"rollout-{i}", *rank, *gpu)
        children.append(_spawn(f"rollout-{i}", cmd, run_dir))
    distill = cfg.trainer.algo.distill
    if distill is not None and distill.teacher.type == "actor":  # on-policy distillation from teacher actors
        for i in range(distill.teacher.actors):
            cmd = node_command("teacher", config_path, run_dir, nats_url, "--actor-id", f"teacher-{i}")
            children.append(_spawn(f"teacher-{i}", cmd, run_dir))
    port = free_port()
    for rank in range(cfg.trainer.ranks):
        cmd = node_command(
            "trainer",
            config_path,
            run_dir,
            nats_url,
            "--actor-id",
            f"trainer-{rank}",
            "--rank",
            str(rank),
            "--world-size",
            str(cfg.trainer.ranks),
            "--master-port",
            str(port),
        )
        children.append(_spawn(f"trainer-{rank}", cmd, run_dir))
    return children


def stop_children(children: list[Child], grace_s: float = 20.0) -> None:
    """SIGTERM (drain), then SIGKILL whatever is still alive after ``grace_s``."""
    for c in children:
        if c.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        if c.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc.wait()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def prepare_run_dir(cfg: RunConfig, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.sync.transport == "broadcast" and cfg.sync.broadcast_port == 0:
        cfg.sync.broadcast_port = free_port()  # every actor reads this config: one rendezvous port for all
    config_path = run_dir / "config.yaml"
    config_path.write_text(dump_config(cfg))
    return config_path


def gpu_plan(cfg: RunConfig) -> dict[str, int]:
    """This machine's GPU for each actor of the run that computes on CUDA (:func:`miles.devices.local_gpus`);
    empty for a CPU run (torch is not even imported)."""
    from miles.devices import engine_on_cuda, local_gpus, trainer_on_cuda

    if not (trainer_on_cuda(cfg) or engine_on_cuda(cfg)):
        return {}
    import torch

    return local_gpus(cfg, torch.cuda.device_count())


async def run_local(
    cfg: RunConfig, run_dir: Path, nats_url: str | None, *, quiet: bool = False, gpus: dict[str, int] | None = None
) -> int:
    """Run a whole job on this machine; returns the process exit status. ``gpus``: :func:`gpu_plan`."""
    from miles.bus.server import EmbeddedNats
    from miles.bus.setup import setup_run
    from miles.progress import ProgressView

    server_config = ""
    if nats_url is None and cfg.bus.secure and cfg.bus.credentials_dir is None:
        server_config = await asyncio.to_thread(ensure_local_bundle, cfg, run_dir)
    config_path = prepare_run_dir(cfg, run_dir)
    async with contextlib.AsyncExitStack() as stack:
        if nats_url is None:
            max_payload = cfg.bus.max_payload_mb * 2**20
            embedded = EmbeddedNats(
                run_dir, max_payload=max_payload, extra_config=server_config, go_threads=cfg.bus.embedded_threads
            )
            server = await stack.enter_async_context(embedded)
            nats_url = server.url
        if cfg.bus.credentials_dir is None or (Path(cfg.bus.credentials_dir) / "setup").is_dir():
            await setup_run(cfg.bus, nats_url, cfg.name)  # else the run's operator set it up already
        children = spawn_actors(cfg, config_path, run_dir, nats_url, gpus or {})
        view = ProgressView(cfg, nats_url, quiet=quiet)
        signalled = _StopSignals()
        try:
            status, failure = await _supervise(children, view, signalled)
        finally:
            signalled.remove()
            await asyncio.to_thread(stop_children, children)
            await view.close()
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    if status == 0 and (summary is None or summary.get("status") != "complete"):
        # The controller ended without completing the run (a stop command, a signal): say so, and fail.
        reason = "the run ended before its last step (a stop command or a signal); see logs/controller.log"
        summary = write_incomplete_summary(summary_path, summary, reason)
        view.fail(reason, _tail(children[0].log_path))
        status = 1
    elif status != 0:
        summary = write_incomplete_summary(summary_path, summary, failure or f"exit status {status}")
    if status == 0 and summary is not None:
        view.print_summary(summary, run_dir)
    return status


def ensure_local_bundle(cfg: RunConfig, run_dir: Path) -> str:
    """The run's credentials bundle in ``<run dir>/auth`` (made on the first start, kept on a restart, so the
    run instance stays the same) and the embedded server's config for it; points ``cfg.bus`` at it."""
    from miles.security.bundle import BUNDLE_FILE, server_config, write_bundle

    auth = run_dir / "auth"
    if not (auth / BUNDLE_FILE).exists():
        write_bundle(auth, cfg.name)
    cfg.bus.credentials_dir = str(auth.absolute())
    return server_config(auth)


def write_incomplete_summary(path: Path, summary: dict | None, reason: str) -> dict:
    """summary.json for a run that did not complete: what the controller wrote (if anything), marked so."""
    from miles.actors.run_record import write_json_atomically

    out = dict(summary or {})
    out.update(status="incomplete", reason=reason)
    write_json_atomically(path, out)
    return out


class _StopSignals:
    """SIGTERM and SIGHUP (a scheduler's cancel, a closed terminal) end the run like Ctrl-C does: the actors are
    stopped and the summary says why. Python's default for them would kill the launcher on the spot and leave
    its actors running until their bus outage budget ran out."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            self._loop.add_signal_handler(sig, self._receive, sig)

    def _receive(self, sig: signal.Signals) -> None:
        self.received = self.received or sig

    def remove(self) -> None:
        for sig in self.SIGNALS:
            self._loop.remove_signal_handler(sig)


async def _supervise(children: list[Child], view: ProgressView, signalled: _StopSignals) -> tuple[int, str | None]:
    """Until the controller exits: ``(0, None)``, ``(1, reason)`` when any actor failed first, or
    ``(128 + signal, reason)`` when the launcher was told to stop."""
    controller = children[0]
    await view.start()
    while True:
        await asyncio.sleep(0.5)
        await view.refresh()
        if signalled.received is not None:
            reason = f"miles run received {signalled.received.name}; the actors were stopped"
            view.fail(reason, _tail(controller.log_path))
            return 128 + signalled.received.value, reason
        if controller.proc.poll() is not None:
            if controller.proc.returncode == 0:
                return 0, None
            reason = f"controller exited with status {controller.proc.returncode}"
            view.fail(reason, _tail(controller.log_path))
            return 1, reason
        for c in children[1:]:
            code = c.proc.poll()
            if code is not None and code != 0:
                reason = f"{c.name} exited with status {code} (log: {c.log_path})"
                view.fail(reason, _tail(c.log_path))
                return 1, reason
