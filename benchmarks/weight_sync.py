"""Delta weight codec (miles.sync.delta) vs the entropy bound and vs XOR + zstd-1, in BF16, FP8 and FP4.

    python benchmarks/weight_sync.py --params 1e9 --out benchmarks/results/weight_sync.json

A synthetic model of ``--params`` fp32 master weights (tensors of ``--tensor-elems``, N(0, 0.02)) takes
one Adam-like step ``w - lr * u``, u ~ N(0, 1). Both versions are cast to
each rollout precision (BF16; FP8 e4m3 with a power-of-two per-tensor scale; FP4 e2m1 with MXFP4
block-32 e8m0 scales, codes + scales both delta-coded). ``lr`` is calibrated per precision on a
sample so that the changed fraction is ``--changed`` (defaults: 2% BF16, 1% FP8, 0.5% FP4 codes).

Per precision it reports: changed fraction, delta bytes / full bytes, bits per changed element,
the order-0 entropy bound (per tensor: ``n * H(p)`` for the change mask plus ``k * H0`` of the
best value coding among new values, XOR and difference, summed) and the delta's size relative to
it, the size of XOR + zstd-1 of the same tensors (the slime/Miles encoding) and our advantage over
it, and encode / decode throughput in GB of rollout-precision weights per second on one core
(``torch.set_num_threads(1)``; digests, index and value coding and zstd included).

``--bus`` measures ``sync.mode: delta`` end to end over a real (embedded) nats-server instead:

    python benchmarks/weight_sync.py --bus --params 1e8 --out benchmarks/results/weight_sync_bus.json

a BF16 state of ``--params`` parameters and its successor after one Adam-like step (2% of patterns
changed), sent as a full payload (safetensors) and as a delta: trainer-side encode and put, worker-side
get, decode (deserialise, or apply_state_delta with its digest checks) and the rollout pause
(``TorchEngine.stage_weights`` + ``apply_pending``: the in-place copy into the float32 model).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch
import zstandard

from miles.sync.delta import _bits, _forward, apply_delta, delta_stats, encode_delta
from miles.sync.quant import quantize_fp4, quantize_fp8, unpack_fp4_codes

KINDS = ("bf16", "fp8", "fp4")


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


async def bus_bench(params: float, tensor_elems: int, changed: float, reps: int) -> dict:
    """Full vs delta sync of one BF16 version over an embedded nats-server (see the module docstring)."""
    import tempfile
    from pathlib import Path

    from miles.bus.connect import connect
    from miles.bus.dataplane import WeightStore
    from miles.bus.server import EmbeddedNats
    from miles.engines.torch_engine import TorchEngine
    from miles.sync.delta import apply_state_delta, encode_state_delta
    from miles.sync.payload import deserialize_state, serialize_state

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
    out: dict = {"params": ntensors * tensor_elems, "tensors": ntensors, "lr": lr}
    with tempfile.TemporaryDirectory() as tmp:
        async with EmbeddedNats(Path(tmp) / "bus") as server:
            nc = await connect(server.url, name="bench")
            js = nc.jetstream()
            full = await WeightStore.create(js, "bench", keep_versions=2)
            delta = await WeightStore.create(js, "bench", keep_versions=2, kind="delta")
            engine.stage_weights(prev, 1)
            engine.apply_pending()
            version = 1
            for mode in ("full", "delta"):
                r: dict[str, list[float]] = {}
                for _ in range(reps):
                    version += 1
                    t0 = time.perf_counter()
                    if mode == "full":
                        payload = serialize_state(new, version)
                    else:
                        payload = encode_state_delta(prev, new, version - 1, version)
                    t1 = time.perf_counter()
                    await (full if mode == "full" else delta).put(version, payload)
                    t2 = time.perf_counter()
                    got = await (full if mode == "full" else delta).get(version)
                    t3 = time.perf_counter()
                    state = deserialize_state(got) if mode == "full" else apply_state_delta(prev, got, version - 1)
                    t4 = time.perf_counter()
                    engine.stage_weights(state, version)
                    assert engine.apply_pending()
                    t5 = time.perf_counter()
                    assert all(torch.equal(state[k].view(torch.int16), new[k].view(torch.int16)) for k in new)
                    for key, dt in (("encode_s", t1 - t0), ("put_s", t2 - t1), ("get_s", t3 - t2)):
                        r.setdefault(key, []).append(dt)
                    r.setdefault("decode_s", []).append(t4 - t3)
                    r.setdefault("stage_apply_s", []).append(t5 - t4)
                    r.setdefault("engine_pause_s", []).append(engine.last_pause_s)
                    r["bytes"] = [float(len(payload))]
                    del payload, got, state
                    # the next rep republishes the same step (prev -> new) as a newer version
                out[mode] = {k: _median(v) for k, v in r.items()}
            await nc.close()
    return out


def bus_main(args: argparse.Namespace) -> None:
    import asyncio

    torch.set_num_threads(1)
    res = asyncio.run(bus_bench(args.params, args.tensor_elems, args.changed[0], args.reps))
    f, d = res["full"], res["delta"]
    print(f"\n{res['params'] / 1e6:.0f}M BF16 parameters in {res['tensors']} tensors, one Adam-like step")
    print(f"{'':6} {'bytes':>12} {'encode s':>9} {'put s':>7} {'get s':>7} {'decode s':>9} {'pause s':>8}")
    for name, x in (("full", f), ("delta", d)):
        print(
            f"{name:6} {x['bytes']:12.0f} {x['encode_s']:9.3f} {x['put_s']:7.3f} {x['get_s']:7.3f} "
            f"{x['decode_s']:9.3f} {x['engine_pause_s']:8.4f}"
        )
    print(f"delta / full bytes: {d['bytes'] / f['bytes']:.4f}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump({"meta": {"loadavg": os.getloadavg(), "reps": args.reps}, "results": res}, fh, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=1e9)
    ap.add_argument("--tensor-elems", type=int, default=1 << 24)
    ap.add_argument("--changed", type=float, nargs=3, default=[0.02, 0.01, 0.005], metavar=("BF16", "FP8", "FP4"))
    ap.add_argument("--level", type=int, default=1, help="zstd level of the delta streams")
    ap.add_argument("--out", default=None)
    ap.add_argument("--bus", action="store_true", help="full vs delta sync over an embedded nats-server")
    ap.add_argument("--reps", type=int, default=3, help="--bus: repetitions per mode (medians reported)")
    args = ap.parse_args()
    if args.bus:
        bus_main(args)
        return
    torch.set_num_threads(1)
    lrs = {k: calibrate(k, t) for k, t in zip(KINDS, args.changed)}
    print("lr per precision:", {k: f"{v:.3g}" for k, v in lrs.items()}, flush=True)
    ntensors = max(1, round(args.params / args.tensor_elems))
    keys = ("positions", "changed", "full_bytes", "delta_bytes", "xor_zstd_bytes", "mask_bits", "enc_s", "dec_s")
    acc = {k: dict.fromkeys(keys, 0.0) | {"new": 0.0, "xor": 0.0, "sub": 0.0, "modes": {}} for k in KINDS}
    t_start = time.perf_counter()
    zc = zstandard.ZstdCompressor(level=1)
    for ti in range(ntensors):
        g = torch.Generator().manual_seed(ti)
        w = torch.randn(args.tensor_elems, generator=g) * 0.02
        u = torch.randn(args.tensor_elems, generator=g)
        for kind in KINDS:
            r = acc[kind]
            for prev, new in zip(cast(kind, w), cast(kind, w - lrs[kind] * u)):
                t0 = time.perf_counter()
                payload = encode_delta(prev, new, level=args.level)
                t1 = time.perf_counter()
                out = apply_delta(prev, payload)
                t2 = time.perf_counter()
                assert torch.equal(out.view(torch.uint8), new.view(torch.uint8)) if out.element_size() == 1 else True
                st = delta_stats(payload)
                mode = f"{st['index']}/{st['values']}"
                r["modes"][mode] = r["modes"].get(mode, 0) + 1
                r["enc_s"] += t1 - t0
                r["dec_s"] += t2 - t1
                r["positions"] += st["positions"]
                r["changed"] += st["changed"]
                r["full_bytes"] += prev.numel() * prev.element_size()
                r["delta_bytes"] += len(payload)
                r["xor_zstd_bytes"] += len(zc.compress((_bits(prev) ^ _bits(new)).tobytes()))
                mb, vals = bound_bits(prev, new)
                r["mask_bits"] += mb
                for m, v in vals.items():
                    r[m] += v
        if ti % 8 == 7 or ti == ntensors - 1:
            print(f"  {ti + 1}/{ntensors} tensors, {time.perf_counter() - t_start:.0f}s", flush=True)
    rows = {}
    for kind, r in acc.items():
        best_val = min(r["new"], r["xor"], r["sub"])
        bound_bytes = (r["mask_bits"] + best_val) / 8
        k = max(r["changed"], 1)
        rows[kind] = {
            "lr": lrs[kind],
            "elements": int(r["positions"]),
            "changed_fraction": r["changed"] / r["positions"],
            "full_bytes": int(r["full_bytes"]),
            "delta_bytes": int(r["delta_bytes"]),
            "delta_over_full": r["delta_bytes"] / r["full_bytes"],
            "bits_per_changed": 8 * r["delta_bytes"] / k,
            "bound_bits_per_changed": 8 * bound_bytes / k,
            "bound_mask_bits_per_changed": r["mask_bits"] / k,
            "bound_value_bits_per_changed": {m: r[m] / k for m in ("new", "xor", "sub")},
            "delta_over_bound": r["delta_bytes"] / bound_bytes,
            "xor_zstd1_bytes": int(r["xor_zstd_bytes"]),
            "xor_zstd1_over_delta": r["xor_zstd_bytes"] / r["delta_bytes"],
            "encode_GBps": r["full_bytes"] / r["enc_s"] / 1e9,
            "decode_GBps": r["full_bytes"] / r["dec_s"] / 1e9,
            "modes": r["modes"],
        }
    hdr = (
        f"{'dtype':5} {'changed':>8} {'delta/full':>10} {'bits/chg':>8} {'bound':>6} {'/bound':>6} "
        f"{'XOR+zstd1':>10} {'x smaller':>9} {'enc GB/s':>8} {'dec GB/s':>8}"
    )
    print(f"\n{args.params:.3g} parameters, {ntensors} tensors of {args.tensor_elems}, zstd level {args.level}")
    print(hdr)
    for kind, x in rows.items():
        print(
            f"{kind:5} {x['changed_fraction']:8.3%} {x['delta_over_full']:10.4f} {x['bits_per_changed']:8.2f} "
            f"{x['bound_bits_per_changed']:6.2f} {x['delta_over_bound']:6.3f} {x['xor_zstd1_bytes'] / 1e6:9.1f}M "
            f"{x['xor_zstd1_over_delta']:9.2f} {x['encode_GBps']:8.2f} {x['decode_GBps']:8.2f}"
        )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        meta = {
            "params": args.params,
            "tensor_elems": args.tensor_elems,
            "level": args.level,
            "loadavg": os.getloadavg(),
            "seconds": time.perf_counter() - t_start,
        }
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
