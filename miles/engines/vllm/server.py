"""Start, watch and restart one vLLM server process (the worker owns it, like ``miles run`` owns nats-server).

The server runs from the vLLM environment (:mod:`miles.engines.vllm.env`) with Miles' weight loader as its
worker extension, token ids in and out (``--skip-tokenizer-init``: the worker tokenizes, the server never
re-tokenises), the sampled tokens' log-probs after temperature (``--logprobs-mode processed_logprobs``), and
the RL endpoints (``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/resume``, ``/collective_rpc``,
``/update_weight_version``) plus the token-in/token-out ``/inference/v1/generate`` (``--enable-scale-out``).
Its output goes to ``<log_path>``; a server that exits is seen by :meth:`VllmServer.exited`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import structlog

from miles.child_process import die_with_parent
from miles.config import LoraConfig, VllmEngineConfig
from miles.engines.base import EngineError
from miles.engines.server_client import ServerClient
from miles.ports import free_port

log = structlog.get_logger(__name__)

WORKER_DIR = Path(__file__).parent / "worker"  # miles_vllm_worker.py: on the server's PYTHONPATH
WORKER_EXTENSION = "miles_vllm_worker.MilesWeightLoader"


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM accepts


def server_command(
    python: str | Path, cfg: VllmEngineConfig, model_dir: str | Path, port: int, lora: LoraConfig | None = None
) -> list[str]:
    """The server's command line; with ``lora``, LoRA serving sized for its adapters (``cfg.max_loras`` of them
    in one batch: requests still running on older adapters share batches with the newest)."""
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", cfg.dtype,
        "--skip-tokenizer-init",
        "--logprobs-mode", "processed_logprobs",
        "--enable-scale-out",
        "--worker-extension-cls", WORKER_EXTENSION,
        "--max-num-seqs", str(cfg.max_num_seqs),
        "--seed", str(cfg.seed),
    ]  # fmt: skip
    if cfg.max_context is not None:
        cmd += ["--max-model-len", str(cfg.max_context)]
    if cfg.enforce_eager:
        cmd.append("--enforce-eager")
    if lora is not None:
        rank = next((r for r in LORA_RANKS if r >= lora.rank), None)
        if rank is None:
            raise ValueError(f"trainer.lora.rank {lora.rank} is above vLLM's largest --max-lora-rank {LORA_RANKS[-1]}")
        cmd += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(cfg.max_loras)]
    return cmd + list(cfg.extra_args)


class VllmServer:
    """One vLLM server process on a free loopback port. :meth:`start` returns once ``/health`` answers."""

    def __init__(
        self,
        cfg: VllmEngineConfig,
        python: str | Path,
        model_dir: str | Path,
        log_path: Path,
        *,
        lora: LoraConfig | None = None,
    ) -> None:
        self.cfg = cfg
        self.lora = lora
        self.python = Path(python)
        self.model_dir = Path(model_dir)
        self.log_path = log_path
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def exited(self) -> int | None:
        """The exit status of a server that is gone, else None."""
        return None if self.proc is None else self.proc.poll()

    async def start(self) -> None:
        self.port = free_port()
        env = dict(os.environ)
        env.update(
            VLLM_SERVER_DEV_MODE="1",
            VLLM_CPU_KVCACHE_SPACE=str(self.cfg.kv_cache_gib),
            VLLM_CPU_OMP_THREADS_BIND="nobind",  # share the cores with the worker, as the torch engine does
            OMP_NUM_THREADS=str(self.cfg.threads),
            PYTHONPATH=os.pathsep.join(p for p in (str(WORKER_DIR), env.get("PYTHONPATH", "")) if p),
            VLLM_NO_USAGE_STATS="1",
            VLLM_CONFIGURE_LOGGING="1",
        )
        if self.lora is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter and /v1/unload_lora_adapter
        env.pop("VIRTUAL_ENV", None)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = server_command(self.python, self.cfg, self.model_dir, self.port, self.lora)
        with open(self.log_path, "ab") as out:
            out.write(f"\n=== miles: starting vLLM ({time.strftime('%H:%M:%S')}): {' '.join(cmd)}\n".encode())
            out.flush()
            # Its own session: a signal to the worker's group does not reach the server; close() stops it,
            # and a SIGKILLed worker's death does (die_with_parent).
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, **die_with_parent()
            )
        self.starts += 1
        log.info("vllm_server_starting", pid=self.proc.pid, port=self.port, log=str(self.log_path))
        await self._wait_healthy()

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        async with ServerClient(self.url, server="vLLM", timeout_s=5.0, max_connections=1) as client:
            while True:
                code = self.exited()
                if code is not None:
                    raise EngineError(f"vLLM server exited with status {code} while starting: {self._log_tail()}")
                if await client.healthy():
                    log.info("vllm_server_ready", pid=self.pid, port=self.port)
                    return
                if time.monotonic() > deadline:
                    await asyncio.to_thread(self.kill)
                    raise EngineError(
                        f"vLLM server not healthy after {self.cfg.startup_timeout_s:.0f} s "
                        f"(rollout.engine.startup_timeout_s): {self._log_tail()}"
                    )
                await asyncio.sleep(0.5)

    def _log_tail(self, lines: int = 6) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return f"(no log at {self.log_path})"
        return f"see {self.log_path}; last lines: " + " | ".join(line[-200:] for line in text[-lines:])

    def kill(self) -> None:
        """SIGKILL the server's whole process group (API server, engine core, workers) and reap it."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log.error("vllm_server_not_reaped", pid=proc.pid)

    async def stop(self) -> None:
        """SIGTERM, a grace period, then SIGKILL."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            await asyncio.to_thread(self.kill)
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        for _ in range(50):
            if proc.poll() is not None:
                break
            await asyncio.sleep(0.1)
        await asyncio.to_thread(self.kill)
