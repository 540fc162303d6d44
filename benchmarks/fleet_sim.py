"""Fleet simulation of sync vs async Miles on a virtual clock (miles/sim/fleet.py).

    python benchmarks/fleet_sim.py --gpus 64 256 1024 --sigma 0 0.5 1 --eta 0 1 2 4 8
    python benchmarks/fleet_sim.py --preset machine --eta 0 2 4 --seeds 0 1 2 3 4
    python benchmarks/fleet_sim.py --eta 2 4 --stale-prefix discard mask   # re-queue long groups vs mask

``--stale-prefix`` is ``staleness.stale_prefix``: ``discard`` re-queues a group whose first tokens are past the
bound (regenerating it), ``mask`` trains it with those tokens out of the loss. ``--admit-by`` is
``rollout.admit_by``: a worker's room for groups comes back when a group is stored (``groups``) or one seat per
finished episode (``episodes``).

``--preset fleet``: a 7B-class model on H100-class GPUs (see the module docstring of miles.sim.fleet and
benchmarks/results/fleet_sim.md for where each number comes from). ``--preset machine``: this 2-core machine
running recipes/async-longtail.yaml as one engine (its two workers' 8 groups in flight on one core) and one
trainer rank (the other core), calibrated from its measured step. ``--groups-in-flight`` overrides the
preset's groups per engine (``rollout.groups_in_flight``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from miles.sim.fleet import EngineModel, FleetParams, FleetResult, LengthModel, simulate


def preset(name: str, gpus: int, sigma: float, steps: int) -> FleetParams:
    if name == "machine":
        # recipes/async-longtail.yaml: 8 groups x 8 per step; 2 workers x groups_in_flight 4 share the rollout
        # core, modelled as one engine of 32 rows playing 8 groups; completions (answer + <eos>) p50 6, p99 57;
        # a group shares its prompt, hence most of its length.
        return FleetParams(
            gpus=2,
            trainer_gpus=1,
            groups_per_step=8,
            group_size=8,
            groups_in_flight=8,
            steps=steps,
            warmup_steps=2,
            engine=EngineModel(max_batch=32, step_base_s=0.003, step_per_seq_s=0.00005),
            lengths=LengthModel(median=6, sigma=sigma, prompt_share=0.8, min_len=2, max_len=57),
            # Fitted: the measured per-step training cost (0.15 s + 0.00016 s/token) x 0.85, the one knob fitted
            # to the 2026-12-03 runs' staleness and re-queue counts (benchmarks/results/fleet_sim.md).
            train_s_per_token=0.000136,
            train_overhead_s=0.1275,
            transfer_s=0.03,
            pause_s=0.02,
            colocated_switch_s=0.0,
            dataset=2000,
        )
    # Fleet: one step trains 16 completions per GPU (groups of 16, groups_per_step = gpus); each engine's worker
    # plays 3 groups, the engine's 48 rows; the measured steps are a steady-state window of a longer run: the
    # last three quarters, a window long against a straggler's life (~20 steps at the 32k clip, sigma 1).
    return FleetParams(
        gpus=gpus,
        groups_per_step=gpus,
        group_size=16,
        groups_in_flight=3,
        steps=steps,
        warmup_steps=steps // 4,
        open_ended=True,
        lengths=LengthModel(median=2000, sigma=sigma, prompt_share=0.5, max_len=32768),
        dataset=max(4096, 8 * gpus),
    )


def row(r: FleetResult, sync: FleetResult | None) -> dict:
    p = r.params
    return {
        "mode": p.mode,
        "gpus": p.gpus,
        "sigma": p.lengths.sigma,
        "eta": p.eta if p.mode == "async" else 0,
        "stale_prefix": p.stale_prefix if p.mode == "async" else "-",
        "admit_by": p.admit_by if p.mode == "async" else "-",
        "seed": p.seed,
        "groups_in_flight": p.groups_in_flight,
        "rollout_gpus": r.rollout_gpus,
        "trainer_gpus": r.trainer_gpus,
        "samples_per_s": round(r.samples_per_s, 3),
        "steps_per_s": round(r.steps_per_s, 5),
        "speedup_vs_sync": round(r.samples_per_s / sync.samples_per_s, 3) if sync else None,
        "bound_samples_per_s": round(r.bound_samples_per_s, 3),
        "bound_vs_sync": round(r.bound_samples_per_s / sync.samples_per_s, 3) if sync else None,
        "fraction_of_bound": round(r.fraction_of_bound, 3),
        "staleness_mean": round(r.staleness_mean, 3),
        "staleness_max": r.staleness_max,
        "trained_groups": r.trained_groups,
        "requeued": r.requeued,
        "requeued_len_mean": round(r.requeued_len_mean, 1),
        "trained_len_mean": round(r.trained_len_mean, 1),
        "regenerated_fraction": round(r.regenerated_fraction, 3),
        "masked_fraction": round(r.masked_fraction, 3),
        "engine_fill": round(r.engine_fill, 3),
        "trainer_busy": round(r.trainer_busy, 3),
        "sim_s": round(r.sim_s, 2),
        "events": r.events,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["fleet", "machine"], default="fleet")
    ap.add_argument("--gpus", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--sigma", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    ap.add_argument("--eta", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--stale-prefix", nargs="+", choices=["discard", "mask"], default=["mask"])
    ap.add_argument("--steps", type=int, default=None, help="default: 120 (fleet), 100 (machine)")
    ap.add_argument(
        "--groups-in-flight", type=int, nargs="+", default=[None], help="per engine (default: the preset's)"
    )
    ap.add_argument("--admit-by", nargs="+", choices=["groups", "episodes"], default=["groups"])
    ap.add_argument("--out", type=Path, default=None, help="write every row as JSON here")
    args = ap.parse_args(argv)
    steps = args.steps or (100 if args.preset == "machine" else 120)
    gpus_list = [2] if args.preset == "machine" else args.gpus
    sigmas = [1.1] if args.preset == "machine" and args.sigma == [0.0, 0.5, 1.0] else args.sigma
    rows: list[dict] = []
    started = time.perf_counter()
    for gpus in gpus_list:
        for sigma in sigmas:
            for seed in args.seeds:
                base = dataclasses.replace(preset(args.preset, gpus, sigma, steps), seed=seed)
                sync = simulate(dataclasses.replace(base, mode="sync"))
                rows.append(row(sync, sync))
                for gif in args.groups_in_flight:
                    played = dataclasses.replace(base, groups_in_flight=gif or base.groups_in_flight)
                    for eta in args.eta:
                        for prefix in args.stale_prefix:
                            for admit_by in args.admit_by:
                                run = dataclasses.replace(played, mode="async", eta=eta, stale_prefix=prefix)
                                rows.append(row(simulate(dataclasses.replace(run, admit_by=admit_by)), sync))
    cols = [
        "mode", "gpus", "sigma", "eta", "stale_prefix", "admit_by", "groups_in_flight", "seed", "samples_per_s",
        "speedup_vs_sync",
        "bound_vs_sync", "fraction_of_bound", "staleness_mean", "staleness_max", "requeued", "requeued_len_mean",
        "trained_len_mean", "regenerated_fraction", "masked_fraction", "engine_fill", "trainer_busy",
    ]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    print(f"# {len(rows)} runs in {time.perf_counter() - started:.1f} s wall", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps({"preset": args.preset, "steps": steps, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
