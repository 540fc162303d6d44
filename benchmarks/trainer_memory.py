"""Peak memory of two FSDP2 trainer ranks during a step, a checkpoint and a weight export: sharded/streamed
(this issue) against today's rank-0 full-state path, side by side in one run.

    python benchmarks/trainer_memory.py --out benchmarks/results/trainer_memory.json

Two gloo ranks (``torch.set_num_threads(1)`` each) shard a randomly initialised HF ``LlamaForCausalLM``
(default: hidden 768, 12 layers, MLP 2048, vocab 32000, untied: 134M parameters, fp32 master weights,
AdamW) and go through these phases, separated by barriers, with ``gc.collect()`` + ``malloc_trim(0)``
before each so a phase does not inherit freed-but-retained heap from the previous one:

1. ``step``: one training step (forward, backward, AdamW) with a plain next-token loss on ``--tokens``
   tokens per rank, after an unmeasured warm-up step that allocates the optimizer state.
2. ``checkpoint``: :func:`miles.backends.fsdp_checkpoint.save_sharded` (DCP, every rank its shard).
3. ``checkpoint_async``: the same with ``asynchronous=True``, staging until the write finished.
4. ``export``: the streamed bf16 export (:func:`~miles.backends.fsdp_export.iter_full_params` ->
   :class:`~miles.sync.transport.bus.BusTransport`) into a real data-plane store on an embedded
   nats-server; rank 0 publishes, rank 1 drains its part of the gathers.
5. ``baseline_checkpoint``: what ``FsdpBackend.save_checkpoint`` does today, re-implemented: full model and
   optimizer state dicts gathered to rank 0 (``full_state_dict=True, cpu_offload=True``), ``torch.save``d
   there atomically.
6. ``baseline_export``: what ``export_weights(bf16)`` + ``publish_weights`` do today: the full state on
   rank 0, cast to bf16, serialised whole, then ``WeightStore.put``.

Memory is the resident set of each rank's process: sampled every ``--sample-ms`` by a thread reading
``/proc/self/statm`` (peak within the phase, and peak minus the phase's starting RSS), plus
``ru_maxrss`` (the process's exact high-water mark) after the new-path phases 1-4 and again at the end.
``ratio`` is rank 0's peak over rank 1's. The nats-server's own memory is another process and not
counted. Linux only (``/proc``, ``malloc_trim``).

Allocator: by default the ranks run with ``MALLOC_MMAP_THRESHOLD_=131072`` and ``MALLOC_TRIM_THRESHOLD_=131072``
(unless already set). glibc otherwise raises its mmap threshold to the size of every large block freed (up to
32 MiB), after which tensors of that size live in the heap and stay resident when freed, so RSS reports the
allocator's history more than live memory (a training step's rise reads ~1.55 GiB that way against ~0.72 GiB
with the fixed threshold, on both ranks alike). ``--glibc-default`` measures without the override.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import platform
import resource
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

MiB = 1024 * 1024
PAGE = os.sysconf("SC_PAGE_SIZE")
PHASES = ("step", "checkpoint", "checkpoint_async", "export", "baseline_checkpoint", "baseline_export")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def trim() -> None:
    """Return freed memory to the OS before a phase. The short pause lets background threads (DCP's writer)
    drop their last references after resolving their future."""
    time.sleep(0.2)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


class RssSampler:
    """A daemon thread sampling RSS; :meth:`phase` records peak and start of a named phase."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.peak = 0
        self.phases: dict[str, dict[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, rss_bytes())

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        trim()
        start = rss_bytes()
        self.peak = start
        started = time.perf_counter()
        yield
        peak = max(self.peak, rss_bytes())
        self.phases[name] = {
            "start_mb": start / MiB,
            "peak_mb": peak / MiB,
            "delta_mb": (peak - start) / MiB,
            "seconds": time.perf_counter() - started,
        }

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def build_model(args: argparse.Namespace) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.mlp,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=max(2 * args.tokens, 256),
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def _baseline_torch_save(obj: Any, path: Any) -> None:
    """The former trainer's checkpoint write: one ``torch.save`` of the whole state, fsynced (the baseline)."""
    import os

    import torch

    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rank_main(rank: int, port: int, url: str, workdir: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from miles.backends.distributed import distributed
    from miles.backends.fsdp_checkpoint import save_sharded
    from miles.backends.fsdp_export import export_specs, iter_full_params
    from miles.bus.connect import connect
    from miles.sync.payload import serialize_state
    from miles.sync.stream_export import PayloadLayout, drain
    from miles.sync.transport.bus import BusTransport
    from miles.sync.transport.dataplane import WeightStore

    torch.set_num_threads(1)
    out: dict[str, Any] = {"rank": rank}
    with distributed(rank, 2, "127.0.0.1", port, timeout_s=600):
        model = build_model(args)
        out["params"] = sum(p.numel() for p in model.parameters())
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        g = torch.Generator().manual_seed(rank)

        def step() -> float:
            x = torch.randint(0, args.vocab, (1, args.tokens), generator=g)  # (1, T)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        loop = asyncio.new_event_loop()
        store = None
        if rank == 0:
            nc = loop.run_until_complete(connect(url, name="trainer-memory"))
            store = loop.run_until_complete(WeightStore.create(nc.jetstream(), "bench", keep_versions=1))
        step()  # warm-up: the optimizer state exists from here on
        dist.barrier()
        sampler = RssSampler(args.sample_ms / 1000)

        with sampler.phase("step"):
            out["loss"] = step()
        dist.barrier()
        with sampler.phase("checkpoint"):
            save_sharded(model, opt, Path(workdir) / "dcp")
        dist.barrier()
        with sampler.phase("checkpoint_async"):
            staged = time.perf_counter()
            handle = save_sharded(model, opt, Path(workdir) / "dcp_async", asynchronous=True)
            out["async_stage_s"] = time.perf_counter() - staged  # the caller is blocked this long
            assert handle is not None
            handle.result()
        dist.barrier()
        with sampler.phase("export"):
            params = lambda: iter_full_params(model, dst=0)  # noqa: E731
            if rank == 0:
                layout = PayloadLayout.plan(export_specs(model), "bfloat16", 1)
                published = loop.run_until_complete(BusTransport(store).publish(layout, params))  # type: ignore[arg-type]
                out["export_bytes"] = published.size
            else:
                drain(params())
        dist.barrier()
        out["max_rss_new_path_mb"] = max_rss_mb()

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        with sampler.phase("baseline_checkpoint"):
            model_state = get_model_state_dict(model, options=options)
            optim_state = get_optimizer_state_dict(model, opt, options=options)
            if rank == 0:
                _baseline_torch_save({"model": model_state, "optimizer": optim_state}, Path(workdir) / "full.pt")
            del model_state, optim_state
            dist.barrier()  # today's save broadcasts rank 0's status: nobody returns before the file is written
        with sampler.phase("baseline_export"):
            state = get_model_state_dict(model, options=options)
            if rank == 0:
                bf16 = {name: t.detach().to(dtype=torch.bfloat16, copy=True) for name, t in state.items()}
                del state
                payload = serialize_state(bf16, 2)
                del bf16
                loop.run_until_complete(store.put(2, payload))  # type: ignore[union-attr]
                del payload
            else:
                del state
            dist.barrier()
        out["max_rss_all_mb"] = max_rss_mb()
        sampler.close()
        out["phases"] = sampler.phases
        if rank == 0:
            loop.run_until_complete(nc.close())
        loop.close()
    Path(workdir, f"rank{rank}.json").write_text(json.dumps(out))


def summarize(ranks: list[dict[str, Any]], args: argparse.Namespace, wall_s: float) -> dict[str, Any]:
    r0, r1 = ranks
    phases = {}
    for name in PHASES:
        a, b = r0["phases"][name], r1["phases"][name]
        phases[name] = {
            "rank0": a,
            "rank1": b,
            "ratio": a["peak_mb"] / b["peak_mb"],
            "delta_ratio": a["delta_mb"] / b["delta_mb"] if b["delta_mb"] > 0 else None,
        }
    return {
        "command": "python benchmarks/trainer_memory.py"
        + (f" --out {args.out}" if args.out else "")
        + (" --glibc-default" if args.glibc_default else ""),
        "model": {
            "params": r0["params"],
            "hidden": args.hidden,
            "layers": args.layers,
            "mlp": args.mlp,
            "vocab": args.vocab,
            "tokens_per_rank": args.tokens,
        },
        "host": {
            "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(),
            "python": platform.python_version(),
            "torch": __import__("torch").__version__,
        },
        "malloc": {k: os.environ.get(k) for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")},
        "export_bytes": r0["export_bytes"],
        "async_stage_s": {"rank0": r0["async_stage_s"], "rank1": r1["async_stage_s"]},
        "phases": phases,
        "max_rss_new_path_mb": {"rank0": r0["max_rss_new_path_mb"], "rank1": r1["max_rss_new_path_mb"]},
        "max_rss_new_path_ratio": r0["max_rss_new_path_mb"] / r1["max_rss_new_path_mb"],
        "max_rss_all_mb": {"rank0": r0["max_rss_all_mb"], "rank1": r1["max_rss_all_mb"]},
        "wall_s": wall_s,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| phase | rank 0 peak (MiB) | rank 1 peak (MiB) | rank 0 / rank 1 | rank 0 rise | rank 1 rise | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, p in result["phases"].items():
        a, b = p["rank0"], p["rank1"]
        lines.append(
            f"| {name} | {a['peak_mb']:.0f} | {b['peak_mb']:.0f} | {p['ratio']:.2f} | "
            f"{a['delta_mb']:.0f} | {b['delta_mb']:.0f} | {a['seconds']:.1f} |"
        )
    stage = result["async_stage_s"]
    lines.append(f"\nasync checkpoint: the caller blocked {stage['rank0']:.2f} s / {stage['rank1']:.2f} s (staging)")
    m = result["max_rss_new_path_mb"]
    lines.append(
        f"\nru_maxrss after step + checkpoints + streamed export: rank 0 {m['rank0']:.0f} MiB, "
        f"rank 1 {m['rank1']:.0f} MiB, ratio {result['max_rss_new_path_ratio']:.2f}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--mlp", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank in the training step")
    parser.add_argument("--sample-ms", type=float, default=5.0)
    parser.add_argument("--out", type=str, default=None, help="write the JSON results here")
    parser.add_argument("--glibc-default", action="store_true", help="keep glibc's dynamic mmap threshold")
    args = parser.parse_args()
    if not args.glibc_default:  # inherited by the spawned ranks (see the module docstring)
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
        os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", "131072")

    import torch.multiprocessing as mp

    from miles.bus.server import EmbeddedNats
    from miles.ports import free_port

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="trainer-memory-") as workdir:
        with EmbeddedNats(Path(workdir) / "bus") as server:
            mp.spawn(rank_main, args=(free_port(), server.url, workdir, args), nprocs=2, join=True)
        ranks = [json.loads(Path(workdir, f"rank{r}.json").read_text()) for r in range(2)]
    result = summarize(ranks, args, time.perf_counter() - started)
    print(f"model: {result['model']['params'] / 1e6:.1f}M parameters, 2 gloo ranks, {result['wall_s']:.0f} s")
    print(table(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
