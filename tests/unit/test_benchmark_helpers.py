"""The pure parts of the benchmark scripts: what they align, parse and summarise, so a figure in
benchmarks/RESULTS.md does not rest on an unchecked helper."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from miles.backends.lr_schedule import lr_at
from miles.config import load_config

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_trl_schedule_follows_miles_lr_step_for_step() -> None:
    trl_grpo = load_script("trl_grpo")
    cfg = load_config(QUICKSTART, ["trainer.steps=40", "trainer.warmup_steps=5"])
    model = torch.nn.Linear(3, 2)
    optimizer, schedule = trl_grpo.optimizer_and_schedule(cfg, model)
    seen = []
    for _ in range(cfg.trainer.steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert seen == pytest.approx([lr_at(cfg.trainer, s) for s in range(cfg.trainer.steps)], rel=1e-12)
    assert seen[0] < seen[4] and seen[-1] == pytest.approx(cfg.trainer.lr * cfg.trainer.min_lr_ratio)


def test_trl_config_mirrors_the_recipe_and_refuses_what_trl_cannot_do(tmp_path: Path) -> None:
    trl_grpo = load_script("trl_grpo")
    cfg = load_config(QUICKSTART)
    kwargs = trl_grpo.grpo_config_kwargs(cfg, str(tmp_path))
    assert kwargs["max_steps"] == cfg.trainer.steps
    assert kwargs["per_device_train_batch_size"] == cfg.trainer.groups_per_step * cfg.rollout.group_size
    assert kwargs["num_generations"] == cfg.rollout.group_size
    assert (kwargs["epsilon"], kwargs["epsilon_high"]) == (
        cfg.trainer.algo.loss.clip_low,
        cfg.trainer.algo.loss.clip_high,
    )
    with pytest.raises(ValueError, match="temperature"):
        trl_grpo.grpo_config_kwargs(load_config(QUICKSTART, ["rollout.sampling.temperature=0"]), str(tmp_path))
    with pytest.raises(ValueError, match="minibatches"):
        trl_grpo.grpo_config_kwargs(load_config(QUICKSTART, ["trainer.algo.minibatches=2"]), str(tmp_path))


def test_checkpoint_interval_summary_and_save_seconds(tmp_path: Path) -> None:
    bench = load_script("checkpoint_interval")
    log = tmp_path / "trainer-0.log"
    lines = [
        json.dumps({"event": "checkpoint.complete", "seconds": 0.5}),
        "not json at all, from a library",
        json.dumps({"event": "weights_put", "seconds": 9.0}),
        json.dumps({"event": "checkpoint.complete", "seconds": 1.5}),
    ]
    log.write_text("\n".join(lines) + "\n")
    assert bench.checkpoint_seconds(log) == [0.5, 1.5]

    def run(every: int, cadence: float) -> dict[str, float]:
        figures = dict.fromkeys(bench.KEYS, 1.0)
        return {**figures, "checkpoint_every": every, "cadence_s_median": cadence}

    runs = [run(1, 0.4), run(1, 0.6), run(10, 0.25), run(100, 0.2), run(100, 0.2)]
    summary = bench.summarize(runs, [1, 10, 100])
    assert summary["1"]["runs"] == 2 and summary["1"]["cadence_s_median"] == pytest.approx(0.5)
    assert summary["1"]["ratio_to_100"]["cadence_s_median"] == pytest.approx(2.5)
    assert summary["10"]["ratio_to_100"]["cadence_s_median"] == pytest.approx(1.25)
    assert "| 1 | 2 | 0.500 |" in bench.table(summary, 100)


def test_step_profile_sorts_py_spy_samples_by_thread_and_activity(tmp_path: Path) -> None:
    step_profile = load_script("step_profile")
    raw = tmp_path / "trainer.pyspy.txt"
    raw.write_text(
        "\n".join(
            [
                'thread (0x1): "MainThread";Runner.run (asyncio/runners.py:118) 50',
                'thread (0x1): "MainThread";main (x.py:1);TrainerLeader._collect (miles/actors/trainer.py:200);'
                "accept (miles/bus/client.py:10) 30",
                'thread (0x2): "trainer-torch";RankWorker.train (t.py:5);Tensor.backward (torch/_tensor.py:600) 20',
                'thread (0x2): "trainer-torch";RankWorker.train (t.py:5);export_params (f.py:9) 10',
                'thread (0x3): "Thread-7";save (torch/distributed/checkpoint/state_dict_saver.py:1) 5',
            ]
        )
        + "\n"
    )
    seconds = step_profile.categorize(raw, 10.0, step_profile.TRAINER_RULES)
    assert seconds["MainThread"] == {"idle": 5.0, "collect trajectories": 3.0}
    assert seconds["trainer-torch"] == {"update: backward": 2.0, "export": 1.0}
    assert seconds["checkpoint writer"] == {"other": 0.5}
