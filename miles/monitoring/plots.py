"""End-of-run PNG plots from a run directory's metrics.jsonl (matplotlib, Agg backend, imported lazily).

* ``reward.png``: mean training reward per step, with held-out eval accuracy points.
* ``staleness.png``: mean and max staleness of the trajectories trained at each step, with the bound.
"""

from __future__ import annotations

import json
from pathlib import Path

REWARD_PNG = "reward.png"
STALENESS_PNG = "staleness.png"


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            rows.append(json.loads(line))
    return sorted({r["step"]: r for r in reversed(rows)}.values(), key=lambda r: r["step"])  # first line wins


def write_plots(
    run_dir: Path,
    *,
    max_staleness: int | None = None,
    evals: dict[int, float] | None = None,
    run_name: str | None = None,
) -> list[Path]:
    """Write reward.png and staleness.png into ``run_dir``; returns their paths.

    ``evals`` maps policy version -> held-out accuracy (merged over the ``eval_accuracy`` entries of
    metrics.jsonl; the pre-training eval of version 0 is only known from ``evals``). Step ``s`` trains
    policy version ``s`` into ``s + 1``, so an eval of version ``v`` is drawn at x = ``v`` (after ``v``
    steps), on the same axis as the steps.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    evals = {
        **{int(r["policy_version"]): float(r["eval_accuracy"]) for r in rows if r.get("eval_accuracy") is not None},
        **(evals or {}),
    }
    name = f"run {run_name}: " if run_name else ""
    steps = [r["step"] for r in rows]
    written = []

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    reward = [(r["step"], r["reward_mean"]) for r in rows if r.get("reward_mean") is not None]
    if reward:
        ax.plot(
            [s for s, _ in reward], [v for _, v in reward], "-", color="tab:blue", lw=1.5, label="mean reward (train)"
        )
    if evals:
        xs = sorted(evals)
        ax.plot(xs, [evals[x] for x in xs], "o--", color="tab:orange", ms=7, lw=1, label="eval accuracy (held-out)")
    ax.set_title(f"{name}training reward per step and held-out eval accuracy")
    ax.set_xlabel("optimizer step (eval points at the policy version = steps done)")
    ax.set_ylabel("reward / accuracy")
    ax.grid(alpha=0.3)
    if reward or evals:
        ax.legend(loc="best")
    else:
        ax.text(0.5, 0.5, "no steps recorded", transform=ax.transAxes, ha="center")
    fig.tight_layout()
    path = run_dir / REWARD_PNG
    fig.savefig(path)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    if rows:
        marker = "s" if len(rows) <= 60 else ""
        maxes = [r.get("staleness_max", 0) for r in rows]
        ax.plot(steps, maxes, marker=marker, ms=4, color="tab:red", lw=1, drawstyle="steps-mid", label="max", zorder=3)
        means = [r.get("staleness_mean", 0.0) for r in rows]
        ax.plot(steps, means, "-", color="tab:blue", lw=1.5, label="mean", zorder=4)
    else:
        ax.text(0.5, 0.5, "no steps recorded", transform=ax.transAxes, ha="center")
    top = max([r.get("staleness_max", 0) for r in rows] + [0])
    if max_staleness is not None:
        ax.axhline(
            max_staleness, color="dimgray", ls="--", lw=1.5, zorder=1, label=f"bound (max_staleness = {max_staleness})"
        )
        top = max(top, max_staleness)
    ax.set_ylim(-0.2, top + 1.2)
    ax.set_title(f"{name}staleness of trained trajectories per step (policy versions behind the trainer)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("staleness (versions)")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    if rows or max_staleness is not None:
        ax.legend(loc="upper left")
    fig.tight_layout()
    path = run_dir / STALENESS_PNG
    fig.savefig(path)
    plt.close(fig)
    written.append(path)
    return written
