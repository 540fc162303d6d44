"""Re-queue a long answer or keep it: ``staleness.stale_prefix`` discard vs mask, side by side in one run.

    python benchmarks/stale_prefix.py --out benchmarks/results/stale_prefix.json
    python benchmarks/stale_prefix.py --admit-by groups episodes   # also rollout.admit_by, each pair an arm

Runs ``miles run recipes/async-longtail.yaml`` at ``staleness.max_staleness=2`` (``--eta``) with
``stale_prefix`` ``discard`` (the group whose first tokens are past the bound is re-queued and generated again)
and ``mask`` (it is trained with those tokens out of the loss), interleaved over ``--seeds`` (discard, mask,
then mask, discard, ...), one run at a time. The engine continues in-flight answers under new weights either
way; only what the trainer does with them differs.

From each run's summary.json: the sampled (model) tokens of the trained batches and of every discarded group,
so **regenerated** = tokens of stale re-queued groups / all sampled tokens, and **masked** = tokens kept as
context but left out of the loss / all sampled tokens; eval before -> after (greedy held-out exact match),
staleness, wall and training-window throughput (as benchmarks/async_vs_sync.py measures them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import async_vs_sync as avs  # noqa: E402  (the sibling benchmark's run and CPU-sampling code)

from miles.config import ConfigError, add_override_option, load_config  # noqa: E402

MODES = ("discard", "mask")


def _log(msg: str) -> None:
    print(f"[stale_prefix] {msg}", file=sys.stderr, flush=True)


def token_shares(run_dir: Path) -> dict[str, Any]:
    """Sampled tokens: trained, masked, and thrown away per discard reason, from the run's summary."""
    summary = json.loads((run_dir / "summary.json").read_text())
    discarded = {k: int(v) for k, v in (summary.get("model_tokens_discarded") or {}).items()}
    trained = int(summary.get("model_tokens") or 0)
    total = trained + sum(discarded.values())
    stale = discarded.get("stale", 0)
    return {
        "model_tokens_sampled": total,
        "model_tokens_trained_batches": trained,
        "model_tokens_discarded": discarded,
        "stale_tokens_masked": int(summary.get("stale_tokens_masked") or 0),
        "regenerated_fraction": round(stale / total, 4) if total else None,
        "masked_fraction": round(int(summary.get("stale_tokens_masked") or 0) / total, 4) if total else None,
    }


def _mean_se(values: list[float]) -> tuple[float, float | None]:
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None
    return mean, se


def _fmt(mean: float, se: float | None, spec: str) -> str:
    return f"{mean:{spec}}" + (f" ± {se:{spec}}" if se is not None else "")


def table(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| stale_prefix | admit_by | runs | regenerated tokens | masked tokens | re-queued groups "
        "| eval before -> after | staleness mean | wall s | train-window samples/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    arms = list(dict.fromkeys((r["stale_prefix"], r["admit_by"]) for r in runs))
    for mode, admit_by in arms:
        ok = [r for r in runs if (r["stale_prefix"], r["admit_by"]) == (mode, admit_by) and "error" not in r]
        if not ok:
            continue

        def col(key: str, spec: str, runs_: list[dict[str, Any]] = ok) -> str:
            return _fmt(*_mean_se([float(r[key]) for r in runs_]), spec)

        lines.append(
            f"| {mode} | {admit_by} | {len(ok)} | {col('regenerated_fraction', '.3f')} "
            f"| {col('masked_fraction', '.3f')} "
            f"| {col('trajectories_requeued', '.1f')} | {col('eval_before', '.3f')} -> {col('eval_after', '.3f')} "
            f"| {col('staleness_mean', '.2f')} | {col('wall_s', '.1f')} | {col('train_samples_per_s', '.1f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=avs.DEFAULT_RECIPE)
    add_override_option(p)
    p.add_argument("--eta", type=int, default=2, help="staleness.max_staleness of every run.")
    p.add_argument("--seeds", default="0,1,2", help="Run seeds (each runs both modes).")
    p.add_argument(
        "--admit-by", nargs="+", choices=["groups", "episodes"], default=["groups"], help="rollout.admit_by arms."
    )
    p.add_argument("--sample-s", type=float, default=0.5, help="CPU sampling period.")
    p.add_argument("--timeout-s", type=float, default=900.0, help="Per-run time limit.")
    p.add_argument("--out", help="Write the results JSON here.")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    base = [*args.overrides, f"staleness.max_staleness={args.eta}"]
    try:
        for seed in seeds:
            load_config(HERE.parent / args.recipe, [*base, f"seed={seed}", "staleness.stale_prefix=mask"])
    except ConfigError as exc:
        print(f"stale_prefix: error: {exc}", file=sys.stderr)
        return 2

    from miles.prepare import prepare_model

    for seed in seeds:  # the tiny models are built outside the timings
        prepare_model(load_config(HERE.parent / args.recipe, [*base, f"seed={seed}"]))
    work = Path(tempfile.mkdtemp(prefix="stale-prefix-"))
    env = avs.child_env()
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    arms = [(mode, admit_by) for mode in MODES for admit_by in args.admit_by]
    for i, seed in enumerate(seeds):
        for mode, admit_by in arms if i % 2 == 0 else arms[::-1]:  # alternate the order: drift falls on all
            label = f"{mode}-{admit_by}-seed{seed}"
            overrides = [*base, f"seed={seed}", f"staleness.stale_prefix={mode}", f"rollout.admit_by={admit_by}"]
            out = avs.run_one(label, args.recipe, overrides, work, env, args.sample_s, args.timeout_s)
            out |= {"stale_prefix": mode, "admit_by": admit_by, "seed": seed}
            if "error" not in out:
                out |= token_shares(Path(out["run_dir"]))
                _log(
                    f"{label}: regenerated {out['regenerated_fraction']}, masked {out['masked_fraction']}, "
                    f"eval {out['eval_before']} -> {out['eval_after']}, staleness {out['staleness_mean']}"
                )
            runs.append(out)
    print(table(runs))
    _log(f"{len(runs)} runs in {time.perf_counter() - started:.0f}s; work dir {work}")
    if args.out:
        Path(args.out).write_text(
            json.dumps({"recipe": args.recipe, "eta": args.eta, "seeds": seeds, "runs": runs}, indent=1) + "\n"
        )
    failed = [r["label"] for r in runs if "error" in r]
    if failed:
        print(f"stale_prefix: failed runs: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
