"""Memory of publishing weights from two FSDP2 ranks, per sync mode and model size: does any rank grow by the state?

    python benchmarks/sync_memory.py --out benchmarks/results/sync_memory.json
    python benchmarks/sync_memory.py --sizes 25M 100M --out /tmp/sm.json   # quick

For each model size and each ``sync.mode`` (full, delta, lora) two ranks are spawned (gloo, CPU), shard a
random-init Llama of that size with FSDP2 through Miles' own ``FsdpBackend`` and take one optimizer step.
Rank 0 then publishes versions through the trainer's real ``WeightSender`` into an embedded nats-server (rank
1 follows as a trainer rank does, ``follow_leader``); between versions every weight moves by a factor, so
each delta has changes to encode. Delta mode publishes an anchor and two deltas; full and LoRA three versions.

Each rank samples its own RSS every few milliseconds; the JSON has a list ``rows`` of ``{mode, params, rank,
train_rss_bytes, publish_peak_rss_bytes}``: RSS after the training step, and the peak while publishing. The
growth (peak - train) is what sync costs a rank: a streamed mode should add about one parameter (plus the
data plane's buffer); a mode that keeps or gathers the whole state adds it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import structlog
import torch

from miles.training.rank_worker import RankWorker

SIZES = {  # name -> (hidden, intermediate, layers); vocab 8192 (embedding and head untied)
    "25M": (512, 1408, 6),
    "100M": (1024, 2816, 7),
    "400M": (1024, 2816, 30),
}
VERSIONS = 3


class PeakRss:
    """This process's peak RSS while ``sampling`` (a thread polling every ``period_s``)."""

    def __init__(self, period_s: float = 0.005) -> None:
        self.period_s = period_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._proc = psutil.Process()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self.period_s)

    def __enter__(self) -> PeakRss:
        self.peak = self._proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def _model(size: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, intermediate, layers = SIZES[size]
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=8192,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg)


def _rank_main(rank: int, world_size: int, port: int, size: str, mode: str, out: str) -> None:
    from miles.actors.trainer_ranks import LeaderRanks, follow_leader
    from miles.backends.distributed import distributed
    from miles.backends.fsdp import FsdpBackend
    from miles.config import load_config

    torch.set_num_threads(1)
    overrides = [f"sync.mode={mode}", "sync.dtype=bfloat16", "sync.anchor_every=10"]
    if mode == "lora":
        overrides += ["trainer.lora.rank=8", "trainer.lora.alpha=16"]
    cfg = load_config(None, overrides)
    with distributed(rank, world_size, "127.0.0.1", port, timeout_s=600):
        model = _model(size)
        params = sum(p.numel() for p in model.parameters())
        backend = FsdpBackend(model, cfg.trainer, rank=rank, world_size=world_size)
        del model
        worker = MovingWorker(backend, cfg, Path(out) / f"run-{rank}", pad_id=0)
        ids = torch.randint(0, 8192, (1, 16), generator=torch.Generator().manual_seed(rank))
        positions = torch.arange(16).unsqueeze(0)
        scored = backend.model(ids, positions, torch.roll(ids, -1, dims=1), False)  # the root: FSDP2 unshards
        (-scored.logp.mean()).backward()
        backend.optimizer.step()
        backend.optimizer.zero_grad(set_to_none=True)
        train_rss = psutil.Process().memory_info().rss
        with PeakRss() as peak:
            if rank == 0:
                asyncio.run(_publish(cfg, LeaderRanks(worker), Path(out)))
            else:
                follow_leader(worker)
        row = {
            "mode": mode,
            "params": params,
            "rank": rank,
            "train_rss_bytes": train_rss,
            "publish_peak_rss_bytes": peak.peak,
        }
    (Path(out) / f"row-{rank}.json").write_text(json.dumps(row))


class MovingWorker(RankWorker):
    """A trainer rank with one more collective: move every trained weight a little (a stand-in for an optimizer
    step between versions, so that deltas have changes to encode)."""

    def move(self) -> None:
        with torch.no_grad():
            for p in self.backend.model.parameters():  # type: ignore[attr-defined]
                if p.requires_grad:
                    p.mul_(1.003)


async def _publish(cfg: Any, ranks: Any, out: Path) -> None:
    from miles.bus.client import Bus
    from miles.bus.server import EmbeddedNats
    from miles.sync.publisher import Lineage
    from miles.sync.sender import build_sender

    async with EmbeddedNats(out, max_payload=8 * 2**20) as server:
        bus = await Bus.open(cfg.bus, server.url, "syncmem", "trainer", role="trainer")
        try:
            sender = await build_sender(cfg, bus, ranks, out, structlog.get_logger("sync_memory"))
            await sender.connect(first_start=True)
            for version in range(VERSIONS):
                await sender.publish(version, Lineage(step=version))
                if version + 1 < VERSIONS:
                    await ranks.call("move")
        finally:
            await bus.close()
            await ranks.stop()


def run(size: str, mode: str) -> list[dict[str, Any]]:
    from miles.backends.distributed import spawn_ranks
    from miles.ports import free_port

    with tempfile.TemporaryDirectory(prefix="sync_memory-") as tmp:
        spawn_ranks(_rank_main, 2, 2, free_port(), size, mode, tmp)
        return [json.loads((Path(tmp) / f"row-{r}.json").read_text()) for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["100M", "400M"], choices=sorted(SIZES))
    parser.add_argument("--modes", nargs="+", default=["full", "delta", "lora"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows: list[dict[str, Any]] = []
    for size in args.sizes:
        for mode in args.modes:
            print(f"[sync_memory] {size} {mode}", file=sys.stderr, flush=True)
            rows += run(size, mode)
    print("| mode | params | rank | RSS after a step (MB) | peak while publishing (MB) | growth (MB) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        train, peak = r["train_rss_bytes"] / 2**20, r["publish_peak_rss_bytes"] / 2**20
        print(
            f"| {r['mode']} | {r['params'] / 1e6:.0f}M | {r['rank']} | {train:.0f} | {peak:.0f} | {peak - train:.0f} |"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "command": " ".join(sys.argv),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
            "rows": rows,
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
