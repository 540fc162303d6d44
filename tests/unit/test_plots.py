"""End-of-run plots from a synthetic metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from miles.monitoring.plots import REWARD_PNG, STALENESS_PNG, read_metrics, write_plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _metrics(run_dir: Path, steps: int) -> None:
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(steps):
            row = {
                "step": s,
                "policy_version": s + 1,
                "reward_mean": 0.2 + 0.01 * s,
                "staleness_mean": (s % 3) / 2,
                "staleness_max": s % 3,
                "tokens_per_s": 100.0,
            }
            if (s + 1) % 5 == 0:
                row["eval_accuracy"] = 0.3 + 0.01 * s
            f.write(json.dumps(row) + "\n")
        f.write(json.dumps({"step": 3, "policy_version": 4, "reward_mean": 0.5}) + "\n")  # a replayed line


def test_plots_are_valid_pngs(tmp_path: Path) -> None:
    _metrics(tmp_path, 20)
    assert len(read_metrics(tmp_path)) == 20
    paths = write_plots(tmp_path, max_staleness=2, evals={0: 0.25}, run_name="demo")
    assert [p.name for p in paths] == [REWARD_PNG, STALENESS_PNG]
    for path in paths:
        width, height = _png_size(path)
        assert width > 300 and height > 200
        assert path.stat().st_size > 10_000  # drawn, not blank


def test_plots_without_metrics(tmp_path: Path) -> None:
    paths = write_plots(tmp_path)
    assert all(p.exists() and p.read_bytes()[:8] == PNG_MAGIC for p in paths)
