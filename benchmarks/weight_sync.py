"""Delta weight codec (miles.sync.delta) vs the entropy bound and vs XOR + zstd-1, in BF16, FP8 and FP4.

Three modes; every one prints a table and, with ``--out``, writes JSON (with the host's load average).

**Synthetic** (default)::

    python benchmarks/weight_sync.py --params 1e9 --out benchmarks/results/weight_sync.json

A synthetic model of ``--params`` fp32 master weights (tensors of ``--tensor-elems``, N(0, 0.02)) takes
one Adam-like step ``w - lr * u``, u ~ N(0, 1). Both versions are cast to each rollout precision (BF16;
FP8 e4m3 with a power-of-two per-tensor scale; FP4 e2m1 with MXFP4 block-32 e8m0 scales, codes + scales
both delta-coded). ``lr`` is calibrated per precision on a sample so that the changed fraction is
``--changed`` (defaults: 2% BF16, 1% FP8, 0.5% FP4 codes).

**Training run** (``--train``)::

    python benchmarks/weight_sync.py --train --lr 1e-5 1e-6 --steps 4 --out benchmarks/results/weight_sync_train.json

Real consecutive versions: a randomly initialised ``transformers`` ``LlamaForCausalLM`` (fp32, ~34M
parameters by default) trained with AdamW at each ``--lr`` for ``--steps`` steps on synthetic token
data (a fixed random bigram chain), every pair of consecutive versions cast and measured as above.

Per precision both report: changed fraction, delta bytes / full bytes, bits per changed element, the
order-0 entropy bound (per tensor: ``n * H(p)`` for the change mask plus ``k * H0`` of the best value
coding among new values, XOR and difference, summed) and the delta's size relative to it, the size of
XOR + zstd-1 of the same tensors (the slime/Miles encoding) and our advantage over it, and encode /
decode throughput in GB of rollout-precision weights per second on one core (``torch.set_num_threads(1)``;
digests, index and value coding and zstd included). Throughput is given per CPU-second of the encoding
thread (``time.thread_time``: what one core delivers, robust to other jobs on a shared host) and per
wall-clock second. Encode is timed in the publisher's steady state, where the base's digest is known from
encoding the previous version (``enc``), and cold (``enc cold``: both digests computed).

**Over the bus** (``--bus``)::

    python benchmarks/weight_sync.py --bus --params 1e8 --tensor-elems 4194304 \\
        --out benchmarks/results/weight_sync_bus.json

A BF16 state of ``--params`` parameters and its successor after one Adam-like step (2% of patterns
changed), sent over a real (embedded) nats-server as a full payload (safetensors) and as a delta:
trainer-side encode and put, worker-side get and decode (deserialise, or ``apply_state_delta`` with its
digest checks). The bus's get throughput of the full payload is compared with a raw loopback socket
moving the same bytes (``benchmarks/dataplane.py``'s baseline). The rollout pause is the engine's
``last_pause_s``: a full reload stages the complete state (``TorchEngine.stage_weights``) and copies
every tensor into the float32 model; a delta apply stages only ``SparseValues`` (the changed flat
positions from ``apply_state_delta(..., with_changes=True)`` and their new values, already cast to the
engine's dtype) and ``index_copy_``-s them. The engine is started and idle, so its loop thread applies
staged weights at once; ``stage_apply_s`` is from staging until the engine holds the version.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import zstandard

from miles.sync import delta as D
from miles.sync.delta import _bits, _forward, apply_delta, delta_stats, encode_delta
from miles.sync.quant import quantize_fp4, quantize_fp8, unpack_fp4_codes

KINDS = ("bf16", "fp8", "fp4")
_ZC = zstandard.ZstdCompressor(level=1)


def cast(kind: str, w: torch.Tensor) -> list[torch.Tensor]:
    if kind == "bf16":
        return [w.to(torch.bfloat16)]
    if kind == "fp8":
        return [quantize_fp8(w)[0]]
    return list(quantize_fp4(w))


def codes(t: torch.Tensor) -> np.ndarray:
    return unpack_fp4_codes(t).numpy() if t.dtype == torch.float4_e2m1fn_x2 else _bits(t)


def changed_fraction(kind: str, w: torch.Tensor, u: torch.Tensor, lr: float) -> float:
    a, b = codes(cast(kind, w)[0]), codes(cast(kind, w - lr * u)[0])
    return float((a != b).mean())


def calibrate(kind: str, target: float, n: int = 1 << 20) -> float:
    g = torch.Generator().manual_seed(123)
    w, u = torch.randn(n, generator=g) * 0.02, torch.randn(n, generator=g)
    lo, hi = 1e-9, 1e-1
    for _ in range(30):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if changed_fraction(kind, w, u, mid) < target else (lo, mid)
    return math.sqrt(lo * hi)


def h2(p: float) -> float:
    return 0.0 if p <= 0 or p >= 1 else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def h0_bits(v: np.ndarray) -> float:
    if v.size == 0:
        return 0.0
    c = np.bincount(v.astype(np.int64))
    pr = c[c > 0] / v.size
    return float(-(pr * np.log2(pr)).sum() * v.size)


def bound_bits(prev: torch.Tensor, new: torch.Tensor) -> tuple[float, dict[str, float]]:
    a, b = codes(prev), codes(new)
    idx = np.flatnonzero(a != b)
    n, k = a.size, idx.size
    width = 4 if prev.dtype == torch.float4_e2m1fn_x2 else a.dtype.itemsize * 8
    vals = {m: h0_bits(_forward(i, a[idx], b[idx], width)) for i, m in enumerate(("new", "xor", "sub"))}
    return n * h2(k / n) if n else 0.0, vals


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _timed(fn):
    c0, w0 = time.thread_time(), time.perf_counter()
    out = fn()
    return out, time.thread_time() - c0, time.perf_counter() - w0


# --------------------------------------------------------------------------- codec statistics


_KEYS = ("positions", "changed", "full_bytes", "delta_bytes", "xor_zstd_bytes", "mask_bits", "new", "xor", "sub")
_TIMES = ("enc_cpu", "enc_wall", "enc_cold_cpu", "enc_cold_wall", "dec_cpu", "dec_wall", "fast_cpu", "fast_wall")


def new_acc() -> dict:
    return dict.fromkeys(_KEYS + _TIMES, 0.0) | {"modes": {}, "fast_bytes": 0.0}


def measure_pair(acc: dict, prev: torch.Tensor, new: torch.Tensor, level: int) -> None:
    """Encode (cold, then in the publisher's steady state), decode, check and add the statistics."""
    D._DIGESTS.clear()
    cold, c_cpu, c_wall = _timed(lambda: encode_delta(prev, new, level=level))
    D._remember_digest(prev, D._digest(_bits(prev)))  # what the previous version's encode left behind
    payload, e_cpu, e_wall = _timed(lambda: encode_delta(prev, new, level=level))
    assert payload == cold
    out, d_cpu, d_wall = _timed(lambda: apply_delta(prev, payload))
    assert torch.equal(out.view(torch.uint8).reshape(-1), new.contiguous().view(torch.uint8).reshape(-1))
    fast, f_cpu, f_wall = _timed(lambda: encode_delta(prev, new, level=level, classes=False))  # base digest known
    assert torch.equal(apply_delta(prev, fast).view(torch.uint8), out.view(torch.uint8))
    acc["fast_bytes"] += len(fast)
    st = delta_stats(payload)
    mode = f"{st['index']}/{st['values']}" + ("/split" if st.get("split") else "")
    acc["modes"][mode] = acc["modes"].get(mode, 0) + 1
    for key, val in zip(_TIMES, (e_cpu, e_wall, c_cpu, c_wall, d_cpu, d_wall, f_cpu, f_wall)):
        acc[key] += val
    acc["positions"] += st["positions"]
    acc["changed"] += st["changed"]
    acc["full_bytes"] += prev.numel() * prev.element_size()
    acc["delta_bytes"] += len(payload)
    acc["xor_zstd_bytes"] += len(_ZC.compress((_bits(prev) ^ _bits(new)).tobytes()))
    mb, vals = bound_bits(prev, new)
    acc["mask_bits"] += mb
    for m, v in vals.items():
        acc[m] += v


def summarize(acc: dict) -> dict:
    best_val = min(acc["new"], acc["xor"], acc["sub"])
    bound_bytes = (acc["mask_bits"] + best_val) / 8
    k = max(acc["changed"], 1)
    fb = acc["full_bytes"]
    return {
        "elements": int(acc["positions"]),
        "changed_fraction": acc["changed"] / acc["positions"],
        "full_bytes": int(fb),
        "delta_bytes": int(acc["delta_bytes"]),
        "delta_over_full": acc["delta_bytes"] / fb,
        "bits_per_changed": 8 * acc["delta_bytes"] / k,
        "bound_bits_per_changed": 8 * bound_bytes / k,
        "bound_mask_bits_per_changed": acc["mask_bits"] / k,
        "bound_value_bits_per_changed": {m: acc[m] / k for m in ("new", "xor", "sub")},
        "delta_over_bound": acc["delta_bytes"] / bound_bytes if bound_bytes else None,
        "xor_zstd1_bytes": int(acc["xor_zstd_bytes"]),
        "xor_zstd1_over_delta": acc["xor_zstd_bytes"] / acc["delta_bytes"],
        "encode_GBps_cpu": fb / acc["enc_cpu"] / 1e9,
        "encode_GBps_wall": fb / acc["enc_wall"] / 1e9,
        "encode_cold_GBps_cpu": fb / acc["enc_cold_cpu"] / 1e9,
        "encode_cold_GBps_wall": fb / acc["enc_cold_wall"] / 1e9,
        "decode_GBps_cpu": fb / acc["dec_cpu"] / 1e9,
        "decode_GBps_wall": fb / acc["dec_wall"] / 1e9,
        "modes": acc["modes"],
        "no_classes": {  # encode_delta(..., classes=False)
            "delta_bytes": int(acc["fast_bytes"]),
            "bits_per_changed": 8 * acc["fast_bytes"] / k,
            "xor_zstd1_over_delta": acc["xor_zstd_bytes"] / acc["fast_bytes"],
            "encode_GBps_cpu": fb / acc["fast_cpu"] / 1e9,
            "encode_GBps_wall": fb / acc["fast_wall"] / 1e9,
        },
    }


def print_table(rows: dict[str, dict]) -> None:
    print(
        f"{'':14} {'changed':>8} {'delta/full':>10} {'bits/chg':>8} {'bound':>6} {'/bound':>6} {'XOR+zstd1':>10} "
        f"{'x smaller':>9} {'enc GB/s':>13} {'cold':>11} {'dec GB/s':>11}"
    )
    for name, x in rows.items():
        print(
            f"{name:14} {x['changed_fraction']:8.3%} {x['delta_over_full']:10.4f} {x['bits_per_changed']:8.2f} "
            f"{x['bound_bits_per_changed']:6.2f} {x['delta_over_bound']:6.3f} {x['xor_zstd1_bytes'] / 1e6:9.2f}M "
            f"{x['xor_zstd1_over_delta']:9.2f} {x['encode_GBps_cpu']:5.2f} ({x['encode_GBps_wall']:4.2f}w) "
            f"{x['encode_cold_GBps_cpu']:4.2f} ({x['encode_cold_GBps_wall']:4.2f}w) "
            f"{x['decode_GBps_cpu']:4.2f} ({x['decode_GBps_wall']:4.2f}w)"
        )
    for name, x in rows.items():
        f = x["no_classes"]
        print(
            f"{name + ' classes=False':26} {f['bits_per_changed']:6.2f} bits/chg, "
            f"{f['xor_zstd1_over_delta']:5.2f}x smaller than XOR+zstd-1, "
            f"enc {f['encode_GBps_cpu']:4.2f} GB/s ({f['encode_GBps_wall']:4.2f}w)"
        )
    print("GB/s: per CPU-second of the one thread (per wall-clock second in brackets); enc: base digest known")


def write_json(path: str | None, meta: dict, results: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    meta = {"command": " ".join(["python", *sys.argv]), "cpus": os.cpu_count(), "loadavg_end": os.getloadavg()} | meta
    with open(path, "w") as fh:
        json.dump({"meta": meta, "results": results}, fh, indent=2)


def synthetic_main(args: argparse.Namespace) -> None:
    lrs = {k: calibrate(k, t) for k, t in zip(KINDS, args.changed)}
    print("lr per precision:", {k: f"{v:.3g}" for k, v in lrs.items()}, flush=True)
    ntensors = max(1, round(args.params / args.tensor_elems))
    acc = {k: new_acc() for k in KINDS}
    load_start, t_start = os.getloadavg(), time.perf_counter()
    for ti in range(ntensors):
        g = torch.Generator().manual_seed(ti)
        w = torch.randn(args.tensor_elems, generator=g) * 0.02
        u = torch.randn(args.tensor_elems, generator=g)
        for kind in KINDS:
            for prev, new in zip(cast(kind, w), cast(kind, w - lrs[kind] * u)):
                measure_pair(acc[kind], prev, new, args.level)
        if ti % 8 == 7 or ti == ntensors - 1:
            print(f"  {ti + 1}/{ntensors} tensors, {time.perf_counter() - t_start:.0f}s", flush=True)
    rows = {kind: summarize(a) | {"lr": lrs[kind]} for kind, a in acc.items()}
    print(f"\n{args.params:.3g} parameters, {ntensors} tensors of {args.tensor_elems}, zstd level {args.level}")
    print_table(rows)
    meta = {
        "params": args.params,
        "tensor_elems": args.tensor_elems,
        "level": args.level,
        "loadavg_start": load_start,
        "seconds": time.perf_counter() - t_start,
    }
    write_json(args.out, meta, rows)


# --------------------------------------------------------------------------- training run


def train_versions(args: argparse.Namespace, lr: float) -> tuple[list[dict[str, torch.Tensor]], list[float], int]:
    """fp32 state dicts of a small Llama before and after each of ``args.steps`` AdamW steps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(args.seed + 1)
    # synthetic language: a fixed random bigram chain with a few likely successors per token
    succ = torch.randint(0, args.vocab, (args.vocab, 4), generator=g)

    def batch() -> torch.Tensor:
        toks = torch.empty(args.batch, args.seq, dtype=torch.long)
        toks[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=g)
        for i in range(1, args.seq):
            toks[:, i] = succ[toks[:, i - 1], torch.randint(0, 4, (args.batch,), generator=g)]
        return toks

    def snap() -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    versions, losses = [snap()], []
    for step in range(args.steps):
        ids = batch()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        versions.append(snap())
        print(f"  lr {lr:g} step {step + 1}/{args.steps}: loss {losses[-1]:.3f}", flush=True)
    return versions, losses, sum(p.numel() for p in model.parameters())


def train_main(args: argparse.Namespace) -> None:
    results, load_start, t_start = {}, os.getloadavg(), time.perf_counter()
    for lr in args.lr:
        torch.set_num_threads(args.train_threads)
        versions, losses, nparams = train_versions(args, lr)
        torch.set_num_threads(1)
        acc = {k: new_acc() for k in KINDS}
        per_step = {k: [] for k in KINDS}
        for t in range(len(versions) - 1):
            for kind in KINDS:
                before = acc[kind]["changed"], acc[kind]["positions"]
                for name, w in versions[t].items():
                    for prev, new in zip(cast(kind, w), cast(kind, versions[t + 1][name])):
                        measure_pair(acc[kind], prev, new, args.level)
                ch, pos = acc[kind]["changed"] - before[0], acc[kind]["positions"] - before[1]
                per_step[kind].append(ch / pos)
        rows = {kind: summarize(a) | {"changed_fraction_per_step": per_step[kind]} for kind, a in acc.items()}
        print(f"\nLlamaForCausalLM, {nparams / 1e6:.1f}M fp32 parameters, AdamW lr {lr:g}, losses {losses}")
        print_table(rows)
        results[f"lr={lr:g}"] = {"params": nparams, "losses": losses, "precisions": rows}
    meta = {
        "model": {
            "vocab": args.vocab,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "layers": args.layers,
            "seq": args.seq,
            "batch": args.batch,
        },
        "steps": args.steps,
        "level": args.level,
        "loadavg_start": load_start,
        "seconds": time.perf_counter() - t_start,
    }
    write_json(args.out, meta, results)


# --------------------------------------------------------------------------- over the bus


async def bus_bench(params: float, tensor_elems: int, changed: float, reps: int) -> dict:
    """Full vs delta sync of one BF16 version over an embedded nats-server (see the module docstring)."""
    import asyncio
    import tempfile
    from pathlib import Path

    from miles.bus.connect import connect
    from miles.bus.server import EmbeddedNats
    from miles.engines.base import SparseValues
    from miles.engines.torch_engine import TorchEngine
    from miles.sync.delta import apply_state_delta, encode_state_delta
    from miles.sync.payload import deserialize_state, serialize_state
    from miles.sync.transport.dataplane import WeightStore

    ntensors = max(1, round(params / tensor_elems))
    lr = calibrate("bf16", changed)
    prev, new = {}, {}
    for ti in range(ntensors):
        g = torch.Generator().manual_seed(ti)
        w = torch.randn(tensor_elems, generator=g) * 0.02
        u = torch.randn(tensor_elems, generator=g)
        prev[f"t{ti}"], new[f"t{ti}"] = w.to(torch.bfloat16), (w - lr * u).to(torch.bfloat16)

    class Flat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name in prev:
                self.register_parameter(name, torch.nn.Parameter(torch.zeros(tensor_elems)))

        def forward(self, input_ids: torch.Tensor, **kwargs: object) -> torch.Tensor:  # never called
            return input_ids

    engine = TorchEngine(Flat(), pad_token_id=0)

    async def adopted(version: int, timeout_s: float = 600.0) -> None:
        """Until the engine's loop thread has applied ``version`` (it does so at once when idle)."""
        deadline = time.perf_counter() + timeout_s
        while engine.version != version:
            if engine.error is not None:
                raise engine.error
            if time.perf_counter() > deadline:
                raise TimeoutError(f"engine never adopted version {version} (at {engine.version})")
            await asyncio.sleep(0.0005)

    out: dict = {"params": ntensors * tensor_elems, "tensors": ntensors, "lr": lr}
    with tempfile.TemporaryDirectory() as tmp:
        async with EmbeddedNats(Path(tmp) / "bus") as server, engine:
            nc = await connect(server.url, name="bench")
            js = nc.jetstream(timeout=60)
            full = await WeightStore.create(js, "bench", keep_versions=2)
            delta = await WeightStore.create(js, "bench", keep_versions=2, kind="delta")
            assert engine.stage_weights(prev, 1)
            await adopted(1)
            version = 1
            for mode in ("full", "delta"):
                r: dict[str, list[float]] = {}
                for _ in range(reps):
                    version += 1
                    t0 = time.perf_counter()
                    if mode == "full":
                        payload = serialize_state(new, version)
                    else:
                        for t in prev.values():  # as after the previous publish: prev's digests are known
                            D._remember_digest(t, D._digest(_bits(t)))
                        t0 = time.perf_counter()
                        payload = encode_state_delta(prev, new, version - 1, version)
                    t1 = time.perf_counter()
                    await (full if mode == "full" else delta).put(version, payload)
                    t2 = time.perf_counter()
                    got = await (full if mode == "full" else delta).get(version)
                    t3 = time.perf_counter()
                    if mode == "full":
                        state = deserialize_state(got)
                    else:
                        state, changes = apply_state_delta(prev, got, version - 1, with_changes=True)
                    t4 = time.perf_counter()
                    switches = engine.switches  # before staging: the idle engine applies at once
                    if mode == "full":
                        assert engine.stage_weights(state, version)  # complete: every tensor copied in place
                    else:
                        sparse = {
                            k: SparseValues(changes[k], state[k].view(-1)[changes[k]].to(torch.float32)) for k in state
                        }
                        t4 = time.perf_counter()
                        assert engine.stage_weights(sparse, version, base_version=version - 1, complete=False)
                    await adopted(version)
                    t5 = time.perf_counter()
                    assert engine.switches == switches + 1  # applied as one switch
                    assert all(torch.equal(state[k].view(torch.int16), new[k].view(torch.int16)) for k in new)
                    for key, dt in (("encode_s", t1 - t0), ("put_s", t2 - t1), ("get_s", t3 - t2)):
                        r.setdefault(key, []).append(dt)
                    r.setdefault("decode_s", []).append(t4 - t3)
                    r.setdefault("stage_apply_s", []).append(t5 - t4)
                    r.setdefault("engine_pause_s", []).append(engine.last_pause_s)
                    r["bytes"] = [float(len(payload))]
                    if mode == "delta":
                        r["changed"] = [float(sum(c.numel() for c in changes.values()))]
                    del payload, got, state
                    # the next rep republishes the same step (prev -> new) as a newer version
                out[mode] = {k: _median(v) for k, v in r.items()}
            held = engine.model.state_dict()
            assert all(torch.equal(held[k], new[k].float()) for k in new)
            await nc.close()
    return out


def bus_main(args: argparse.Namespace) -> None:
    import asyncio
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dataplane import bench_raw_socket

    load_start = os.getloadavg()
    res = asyncio.run(bus_bench(args.params, args.tensor_elems, args.changed[0], args.reps))
    f, d = res["full"], res["delta"]
    size = int(f["bytes"])
    raw_early, _ = bench_raw_socket(size, args.reps)  # fresh buffer, as WeightStore.get(); sender in a process
    raw = _median(raw_early.get_mb_s) * 2**20
    res["raw_socket_MBps"] = raw / 1e6
    res["full"]["get_MBps"] = f["bytes"] / f["get_s"] / 1e6
    res["full"]["put_MBps"] = f["bytes"] / f["put_s"] / 1e6
    res["get_vs_raw"] = f["bytes"] / f["get_s"] / raw
    res["pause_delta_over_full"] = d["engine_pause_s"] / f["engine_pause_s"]
    print(f"\n{res['params'] / 1e6:.0f}M BF16 parameters in {res['tensors']} tensors, one Adam-like step")
    print(f"{'':6} {'bytes':>12} {'encode s':>9} {'put s':>7} {'get s':>7} {'decode s':>9} {'pause s':>8}")
    for name, x in (("full", f), ("delta", d)):
        print(
            f"{name:6} {x['bytes']:12.0f} {x['encode_s']:9.3f} {x['put_s']:7.3f} {x['get_s']:7.3f} "
            f"{x['decode_s']:9.3f} {x['engine_pause_s']:8.4f}"
        )
    print(f"delta / full bytes: {d['bytes'] / f['bytes']:.4f}; changed positions staged: {d['changed']:.0f}")
    print(
        f"bus get {res['full']['get_MBps']:.0f} MB/s vs raw loopback socket {res['raw_socket_MBps']:.0f} MB/s "
        f"(same {size / 1e6:.0f} MB, fresh buffer): {res['get_vs_raw']:.2f}x"
    )
    print(f"rollout pause, delta apply / full reload: {res['pause_delta_over_full']:.3f}")
    write_json(args.out, {"reps": args.reps, "loadavg_start": load_start}, res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=1e9)
    ap.add_argument("--tensor-elems", type=int, default=1 << 24)
    ap.add_argument("--changed", type=float, nargs=3, default=[0.02, 0.01, 0.005], metavar=("BF16", "FP8", "FP4"))
    ap.add_argument("--level", type=int, default=1, help="zstd level of the delta streams")
    ap.add_argument("--out", default=None)
    ap.add_argument("--bus", action="store_true", help="full vs delta sync over an embedded nats-server")
    ap.add_argument("--reps", type=int, default=3, help="--bus: repetitions per mode (medians reported)")
    ap.add_argument("--train", action="store_true", help="consecutive versions of a real (small) training run")
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-5, 1e-6], help="--train: AdamW learning rates")
    ap.add_argument("--steps", type=int, default=4, help="--train: optimizer steps (versions - 1)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-threads", type=int, default=2, help="--train: torch threads for training only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.bus:
        bus_main(args)
    elif args.train:
        train_main(args)
    else:
        synthetic_main(args)


if __name__ == "__main__":
    main()
