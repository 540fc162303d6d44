"""End-of-run PNG plots from a run directory's record (matplotlib, Agg backend, imported lazily).

* ``reward.png``: mean training reward per step, with the held-out eval accuracy points of evals.jsonl.
* ``staleness.png``: mean and max staleness of the trajectories trained at each step, with the bound.
* ``lengths.png``: completion length (model tokens of the trained episodes) per step: mean, p50, p90, max.
  Long-tailed lengths are what asynchronous rollouts are for, and a p90 or max stuck at max_new_tokens
  means truncation.

Every x axis is the lineage step (batches trained), so the three line up; an evaluation of the version
trained for ``s`` steps is drawn at x = ``s``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REWARD_PNG = "reward.png"
STALENESS_PNG = "staleness.png"
LENGTHS_PNG = "lengths.png"
FIGSIZE = (8, 4.5)
DPI = 110


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl, one row per step in step order (the first line of a step wins, as in the record)."""
    rows = _read_jsonl(run_dir / "metrics.jsonl")
    return sorted({r["step"]: r for r in reversed(rows)}.values(), key=lambda r: r["step"])


def read_evals(run_dir: Path) -> dict[int, float]:
    """evals.jsonl as ``{steps trained into the evaluated version: accuracy}`` (the first line of a step wins)."""
    out: dict[int, float] = {}
    for row in _read_jsonl(run_dir / "evals.jsonl"):
        if row.get("eval_accuracy") is not None:
            out.setdefault(int(row["step"]), float(row["eval_accuracy"]))
    return out


def write_plots(
    run_dir: Path,
    *,
    max_staleness: int | None = None,
    evals: dict[int, float] | None = None,
    run_name: str | None = None,
) -> list[Path]:
    """Write reward.png, staleness.png and lengths.png into ``run_dir``; returns their paths.

    ``evals`` maps steps trained into the evaluated version -> accuracy (the controller's record); it is
    merged over evals.jsonl, so a caller without the record still gets the eval points.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    all_evals = {**read_evals(run_dir), **(evals or {})}
    title = f"run {run_name}: " if run_name else ""
    written = []
    for name, draw in (
        (REWARD_PNG, lambda ax: _reward(ax, rows, all_evals, title)),
        (STALENESS_PNG, lambda ax: _staleness(ax, rows, max_staleness, title)),
        (LENGTHS_PNG, lambda ax: _lengths(ax, rows, title)),
    ):
        fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
        draw(ax)
        ax.xaxis.get_major_locator().set_params(integer=True)  # steps are whole
        fig.tight_layout()
        path = run_dir / name
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def _nothing(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, what, transform=ax.transAxes, ha="center")


def _reward(ax: Any, rows: list[dict[str, Any]], evals: dict[int, float], title: str) -> None:
    reward = [(r["step"], r["reward_mean"]) for r in rows if r.get("reward_mean") is not None]
    if reward:
        ax.plot([s for s, _ in reward], [v for _, v in reward], "-", color="tab:blue", lw=1.5, label="mean reward")
    if evals:
        xs = sorted(evals)
        ax.plot(xs, [evals[x] for x in xs], "o--", color="tab:orange", ms=7, lw=1, label="eval accuracy (held-out)")
    ax.set_title(f"{title}training reward per step and held-out eval accuracy")
    ax.set_xlabel("optimizer step (eval points at the steps trained into the evaluated version)")
    ax.set_ylabel("reward / accuracy")
    ax.grid(alpha=0.3)
    if reward or evals:
        ax.legend(loc="best")
    else:
        _nothing(ax, "no steps recorded")


def _staleness(ax: Any, rows: list[dict[str, Any]], max_staleness: int | None, title: str) -> None:
    steps = [r["step"] for r in rows]
    if rows:
        marker = "s" if len(rows) <= 60 else ""
        maxes = [r.get("staleness_max", 0) for r in rows]
        ax.plot(steps, maxes, marker=marker, ms=4, color="tab:red", lw=1, drawstyle="steps-mid", label="max", zorder=3)
        means = [r.get("staleness_mean", 0.0) for r in rows]
        ax.plot(steps, means, "-", color="tab:blue", lw=1.5, label="mean", zorder=4)
    else:
        _nothing(ax, "no steps recorded")
    top = max([r.get("staleness_max", 0) for r in rows] + [0])
    if max_staleness is not None:
        ax.axhline(
            max_staleness, color="dimgray", ls="--", lw=1.5, zorder=1, label=f"bound (max_staleness = {max_staleness})"
        )
        top = max(top, max_staleness)
    ax.set_ylim(-0.2, top + 1.2)
    ax.set_title(f"{title}staleness of trained trajectories per step (steps behind the trainer)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("staleness (steps)")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    if rows or max_staleness is not None:
        ax.legend(loc="upper left")


def _lengths(ax: Any, rows: list[dict[str, Any]], title: str) -> None:
    measured = [r for r in rows if r.get("length_mean") is not None]
    ax.set_title(f"{title}completion length per step (model tokens of trained episodes)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("tokens")
    ax.grid(alpha=0.3)
    if not measured:
        _nothing(ax, "no completion lengths recorded")
        return
    steps = [r["step"] for r in measured]

    def series(key: str) -> list[float]:
        return [float(r.get(key) or 0.0) for r in measured]

    p50, p90 = series("length_p50"), series("length_p90")
    ax.fill_between(steps, p50, p90, color="tab:blue", alpha=0.15, lw=0, label="p50 to p90")
    ax.plot(steps, series("length_max"), ":", color="tab:red", lw=1.2, label="max")
    ax.plot(steps, p90, "-.", color="tab:purple", lw=1, label="p90")
    ax.plot(steps, p50, "--", color="tab:green", lw=1, label="p50")
    ax.plot(steps, series("length_mean"), "-", color="tab:blue", lw=1.8, label="mean")
    ax.set_ylim(bottom=0)
    ax.legend(loc="best")
