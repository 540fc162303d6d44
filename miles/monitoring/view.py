"""Rich rendering of a monitor snapshot (the dict of :meth:`miles.monitoring.state.RunState.snapshot`)."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

BAR_WIDTH = 30


def _fmt(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def _header(snap: dict[str, Any]) -> Text:
    step = snap["last_step"]
    text = Text()
    text.append(f"miles run {snap['run']}", style="bold")
    text.append(f"  [{snap['status']}]  trainer version {snap['trainer_version']}")
    if not snap["trainer_alive"] and snap["status"] != "done":
        text.append(" (no trainer heartbeat)", style="red")
    text.append(f"  max staleness {snap['max_staleness']}  steps seen {snap['steps_seen']}")
    if step is not None:
        text.append(f"  last step {step['step']} ({_fmt(step['age_s'], '.0f')}s ago)")
    weights = snap.get("weights")
    if weights is not None and weights["mismatches"]:  # a worker rolls out with weights the trainer never published
        text.append(f"  WEIGHT MISMATCH x{weights['mismatches']}", style="bold red")
    return text


def _workers(snap: dict[str, Any]) -> Table:
    table = Table(title="rollout workers", title_justify="left", expand=False)
    for col in ("worker", "version", "lag", "groups", "tokens", "tok/s", "syncs", "last seen"):
        table.add_column(col, justify="left" if col == "worker" else "right")
    bound = snap["max_staleness"]
    for wid, w in snap["workers"].items():
        lag = w["lag"]
        lag_style = "red" if lag is not None and lag > bound else ""
        table.add_row(
            wid,
            str(w["version"]),
            Text(_fmt(lag), style=lag_style),
            str(w["groups"]),
            str(w["tokens"]),
            f"{w['tokens_per_s']:.0f}",
            str(w["syncs"]),
            Text(f"{w['age_s']:.1f}s ago", style="" if w["alive"] else "red"),
        )
    if not snap["workers"]:
        table.add_row("(no worker heartbeats yet)", "", "", "", "", "", "", "")
    return table


def _histogram(snap: dict[str, Any]) -> Table:
    hist = snap["staleness_histogram"]
    total = sum(hist.values())
    top = max(hist.values(), default=0)
    table = Table(title="staleness of trained trajectories", title_justify="left", show_edge=False, box=None)
    table.add_column("lag", justify="right")
    table.add_column("trajectories", justify="left")
    table.add_column("n", justify="right")
    table.add_column("%", justify="right")
    for key, n in hist.items():
        over = int(key) > snap["max_staleness"]
        bar = "█" * (max(1, round(n / top * BAR_WIDTH)) if n else 0)
        table.add_row(
            key,
            Text(bar or "·", style="red" if over else "cyan"),
            str(n),
            f"{100 * n / total:.0f}" if total else "-",
        )
    table.caption = f"mean {_fmt(snap['staleness_mean'], '.2f')}, over bound {snap['staleness_over_bound']}"
    return table


def _flow(snap: dict[str, Any]) -> Table:
    q, r, d = snap["queues"], snap["rates"], snap["discards"]
    table = Table(title="flow", title_justify="left", show_header=False, show_edge=False, box=None)
    table.add_column("what")
    table.add_column("value", justify="right")
    rows: list[tuple[str, str | Text]] = [
        ("prompts waiting (PROMPTS stream)", _fmt(q["prompts_waiting"])),
        ("trajectories waiting for the trainer", _fmt(q["trajectories_waiting"])),
        (f"rollout tokens/s ({r['window_s']:.0f}s window)", f"{r['rollout_tokens_per_s']:.0f}"),
        ("rollout groups/s", f"{r['rollout_groups_per_s']:.2f}"),
        ("trained trajectories/s", f"{r['trained_trajectories_per_s']:.2f}"),
        ("trained tokens/s (last step)", _fmt(r["step_tokens_per_s"], ".0f")),
        ("dropped / requeued", f"{d['dropped']} / {d['requeued']}"),
        ("dead letters (DLQ stream)", _fmt(snap["dead_lettered"])),
    ]
    if snap["controller"] is not None:
        rows.append(
            ("groups issued / discarded", f"{snap['controller']['issued']} / {snap['controller']['discarded']}")
        )
    weights = snap.get("weights")
    if weights is not None:
        bad = bool(weights["mismatches"])
        rows.append(
            (
                "held weights verified / mismatched",
                Text(f"{_fmt(weights['verified'])} / {_fmt(weights['mismatches'])}", style="bold red" if bad else ""),
            )
        )
    for what, value in rows:
        table.add_row(what, value)
    return table


def _trend(snap: dict[str, Any]) -> Text:
    reward = snap["reward"]
    text = Text()
    n = len(reward["trend"])
    text.append(f"reward (last {n} steps) ", style="bold")
    if n:
        text.append(reward["sparkline"], style="green")
        text.append(f"  last {reward['last']:.3f}  mean {reward['mean_last_n']:.3f}")
    else:
        text.append("-")
    evals = snap["evals"]
    text.append("\neval accuracy ", style="bold")
    text.append("  ".join(f"v{k}: {a:.3f}" for k, a in evals.items()) if evals else "-")
    return text


def render(snap: dict[str, Any]) -> RenderableType:
    """The whole live view: header, workers, staleness histogram next to queues and rates, trends."""
    middle = Table.grid(padding=(0, 4))
    middle.add_column()
    middle.add_column()
    middle.add_row(_histogram(snap), _flow(snap))
    return Group(_header(snap), _workers(snap), middle, _trend(snap))
