"""Rich rendering of a monitor snapshot (the dict of :meth:`miles.monitoring.state.RunState.snapshot`).

Anything that means the run is broken rather than slow (a dead engine, failed weight loads, weights that
differ from the trainer's, trajectories past the staleness bound) is red, so it stands out of a busy screen.
"""

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
    text.append(f"  [{snap['status']}]  trainer version {snap['trainer_version']} (step {_fmt(snap['trainer_step'])})")
    if not snap["trainer_alive"] and snap["status"] != "done":
        text.append(" (no trainer heartbeat)", style="red")
    text.append(f"  max staleness {snap['max_staleness']}  steps seen {snap['steps_seen']}")
    if step is not None:
        text.append(f"  last step {step['step']} ({_fmt(step['age_s'], '.0f')}s ago)")
    weights = snap.get("weights")
    if weights is not None and weights["mismatches"]:  # a worker rolls out with weights the trainer never published
        text.append(f"  WEIGHT MISMATCH x{weights['mismatches']}", style="bold red")
    if snap["engine_errors"]:
        text.append(f"  ENGINE ERROR: {', '.join(snap['engine_errors'])}", style="bold red")
    if snap["engine_load_failures"]:
        text.append(f"  weight loads failed x{snap['engine_load_failures']}", style="bold red")
    if snap.get("engine_servers_down"):
        text.append(f"  INFERENCE SERVER DOWN: {', '.join(snap['engine_servers_down'])}", style="bold red")
    if snap.get("engine_restarts"):
        text.append(f"  inference server restarts x{snap['engine_restarts']}", style="bold yellow")
    return text


def _workers(snap: dict[str, Any]) -> Table:
    table = Table(title="rollout workers (lag in steps)", title_justify="left", expand=False)
    columns = ("worker", "state", "version", "step", "lag", "groups", "tokens", "tok/s", "syncs", "loads failed")
    for col in (*columns, "last seen"):
        table.add_column(col, justify="left" if col in ("worker", "state") else "right")
    bound = snap["max_staleness"]
    for wid, w in snap["workers"].items():
        lag = w["lag"]
        table.add_row(
            wid,
            Text(w["state"], style="bold red" if w["engine_error"] else ""),
            str(w["version"]),
            _fmt(w["step"]),
            Text(_fmt(lag), style="red" if lag is not None and lag > bound else ""),
            str(w["groups"]),
            str(w["tokens"]),
            f"{w['tokens_per_s']:.0f}",
            str(w["syncs"]),
            Text(str(w["engine_load_failures"]), style="bold red" if w["engine_load_failures"] else ""),
            Text(f"{w['age_s']:.1f}s ago", style="" if w["alive"] else "red"),
        )
    if not snap["workers"]:
        table.add_row("(no worker heartbeats yet)", *[""] * len(columns))
    return table


def _end_reasons(reasons: dict[str, int]) -> str:
    return " ".join(f"{reason}:{n}" for reason, n in reasons.items()) or "-"


def _episode_cells(e: dict[str, Any]) -> list[str | Text]:
    def warn(n: int) -> Text:
        return Text(str(n), style="yellow" if n else "")

    return [
        str(e["episodes"]),
        _fmt(e["turns_per_episode"], ".2f"),
        str(e["tool_calls"]),
        warn(e["parse_errors"]),
        _fmt(e["env_s_per_episode"], ".2f"),
        warn(e["infra_errors"]),
        warn(e["reward_failed"]),
        str(e["truncated"]),
        _fmt(e["length_mean"], ".1f"),
        _end_reasons(e["end_reasons"]),
    ]


def _episodes(snap: dict[str, Any]) -> Table:
    """Per worker, what its episodes did (totals since the worker started), and all workers together.

    ``infra err`` are sandbox or verifier failures (excluded from training), ``rew failed`` episodes whose
    reward raised, ``trunc`` those whose last turn hit max_new_tokens, ``len`` model tokens per episode."""
    table = Table(title="episodes by worker", title_justify="left", expand=False)
    columns = (
        "worker",
        "episodes",
        "turns/ep",
        "tools",
        "parse err",
        "env s/ep",
        "infra err",
        "rew failed",
        "trunc",
        "len",
        "end reasons",
    )
    for col in columns[:-1]:  # numbers never wrap; the end reasons give way on a narrow terminal
        table.add_column(col, justify="left" if col == "worker" else "right", no_wrap=True)
    table.add_column(columns[-1])
    workers = snap["workers"]
    for i, (wid, w) in enumerate(workers.items()):
        table.add_row(wid, *_episode_cells(w), end_section=len(workers) > 1 and i == len(workers) - 1)
    if len(workers) > 1:
        table.add_row(Text("all", style="bold"), *_episode_cells(snap["rollout_episodes"]))
    if not workers:
        table.add_row("(no worker heartbeats yet)", *[""] * (len(columns) - 1))
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
        ("refused by actors", _fmt(snap.get("refused_total"))),
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


def _step(snap: dict[str, Any]) -> Table:
    """The last step's episode figures next to their totals over every step seen."""
    step, total = snap["last_step"] or {}, snap["trained"]
    table = Table(title="trained episodes", title_justify="left", show_edge=False, box=None)
    table.add_column("")
    table.add_column(f"step {step['step']}" if step else "last step", justify="right")
    table.add_column("all steps", justify="right")

    def count(key: str) -> tuple[str, str]:
        return _fmt(step.get(key), ".0f"), str(total.get(key, 0))

    for what, key in (
        ("samples trained / episodes", None),
        ("infra-excluded (sandbox failures)", "infra_excluded"),
        ("reward failed", "reward_failed"),
        ("truncated", "truncated"),
        ("groups without signal", "groups_without_signal"),
        ("tool calls", "tool_calls"),
        ("parse errors", "parse_errors"),
        ("template mismatches", "template_mismatches"),
    ):
        if key is None:
            last = f"{_fmt(step.get('samples'), '.0f')} / {_fmt(step.get('episodes'), '.0f')}"
            table.add_row(what, last, f"{total.get('samples', 0)} / {total.get('episodes', 0)}")
        else:
            table.add_row(what, *count(key))
    table.add_row("turns / episode", _fmt(step.get("turns_mean"), ".2f"), "")
    table.add_row("env s / episode", _fmt(step.get("env_s_mean"), ".2f"), "")
    lengths = snap["lengths"]["last"]
    table.add_row(
        "length mean / p50 / p90 / max",
        " / ".join(f"{lengths[k]:.0f}" for k in ("mean", "p50", "p90", "max")) if lengths else "-",
        "",
    )
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
    lengths = snap["lengths"]
    text.append("\nlength mean ", style="bold")
    if lengths["trend"]:
        text.append(lengths["sparkline"], style="cyan")
        last = lengths["last"]
        text.append(f"  last mean {last['mean']:.1f}  p90 {last['p90']:.0f}  max {last['max']:.0f}")
    else:
        text.append("-")
    evals = snap["eval_results"]
    text.append("\neval accuracy ", style="bold")
    shown = [
        f"step {_fmt(e['step'])}: {e['accuracy']:.3f}" + (f" ({e['failed']} failed)" if e["failed"] else "")
        for e in evals
    ]
    text.append("  ".join(shown) if shown else "-")
    return text


def render(snap: dict[str, Any]) -> RenderableType:
    """The whole live view: header, workers and their episodes, staleness histogram next to queues and rates,
    the last step's episodes, trends."""
    middle = Table.grid(padding=(0, 4))
    middle.add_column()
    middle.add_column()
    middle.add_row(_histogram(snap), _flow(snap))
    middle.add_row(_step(snap), Text(""))
    alarms = [Text(f"ALARM: {a}", style="bold red") for a in snap.get("alarms", [])]
    return Group(_header(snap), *alarms, _workers(snap), _episodes(snap), middle, _trend(snap))
