import subprocess
import sys
from pathlib import Path

import pytest

from miles.config import ConfigError, RunConfig, apply_overrides, dump_config, load_config

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads(recipe: Path) -> None:
    cfg = load_config(recipe)
    assert isinstance(cfg, RunConfig)


def test_dotted_overrides_are_typed() -> None:
    cfg = load_config(None, ["trainer.lr=2e-5", "rollout.sampling.temperature=0.7", "task.operations=['+', '-']"])
    assert cfg.trainer.lr == pytest.approx(2e-5)
    assert cfg.rollout.sampling.temperature == pytest.approx(0.7)
    assert cfg.task.operations == ["+", "-"]


def test_override_switches_variant() -> None:
    cfg = load_config(None, ["model.type=pretrained", "model.path=/ckpt/x"])
    assert cfg.model.type == "pretrained" and cfg.model.path == "/ckpt/x"


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["trainer.lrr=1"], "trainer.lrr: unknown key"),
        (["trainer.lr=abc"], "trainer.lr:"),
        (["staleness.max_staleness=-1"], "staleness.max_staleness:"),
        (["trainer.ranks=3"], "divisible"),
        (["trainer"], "not of the form"),
        (["sync.mode=lora"], "sync.mode 'lora' needs trainer.lora"),
        (["trainer.lora.rank=2", "sync.dtype=fp4_e2m1"], "not supported with trainer.lora"),
        (["trainer.lora.rank=0"], "trainer.lora.rank:"),
        (["sync.dtype=fp16"], "sync.dtype:"),
    ],
)
def test_bad_overrides_name_the_field(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides)
    assert needle in str(exc.value)
    assert "\n" not in str(exc.value)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="recipe file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("trainer:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"typo.yaml: trainer.stepz: unknown key"):
        load_config(typo)


def test_dump_round_trips(tmp_path: Path) -> None:
    cfg = load_config(None, ["trainer.steps=7"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


def test_apply_overrides_rejects_descending_into_values() -> None:
    with pytest.raises(ConfigError, match="is a value"):
        apply_overrides({"trainer": 3}, ["trainer.lr=1"])


@pytest.mark.parametrize(
    "argv",
    [["miles", "run", "nope.yaml"], ["miles-node", "--role", "rollout", "--set", "bogus.key=1", "--nats-url", "x"]],
)
def test_cli_config_errors_exit_2_without_traceback(argv: list[str]) -> None:
    module = "miles.cli" if argv[0] == "miles" else "miles.node"
    proc = subprocess.run([sys.executable, "-m", module, *argv[1:]], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr


def test_every_problem_is_reported_at_once_with_renamed_keys_named(tmp_path: Path) -> None:
    recipe = tmp_path / "old.yaml"
    recipe.write_text("rollout:\n  groups_per_batch: 4\ntrainer:\n  eval_every: 10\n  lr: fast\n")
    with pytest.raises(ConfigError) as exc:
        load_config(recipe, ["trainer.steps=-1", "no_equals_sign"])
    lines = str(exc.value).splitlines()
    assert lines[0] == f"{recipe}: 5 problems:"
    body = "\n".join(lines[1:])
    assert "rollout.groups_per_batch: unknown key; renamed: use rollout.groups_in_flight" in body
    assert "trainer.eval_every: unknown key; renamed: use eval.every" in body
    assert "trainer.lr: Input should be a valid number" in body
    assert "trainer.steps: Input should be greater than" in body
    assert "override 'no_equals_sign' is not of the form dotted.key=value" in body


def test_miles_run_lists_three_mistakes_with_exit_2_and_no_traceback(tmp_path: Path) -> None:
    recipe = tmp_path / "three.yaml"
    recipe.write_text("trainer:\n  stepz: 3\n  lr: fast\nrollout:\n  groups_per_batch: 2\n")
    proc = subprocess.run(
        [sys.executable, "-m", "miles.cli", "run", str(recipe)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "3 problems" in proc.stderr
    for needle in ("trainer.stepz: unknown key", "trainer.lr:", "renamed: use rollout.groups_in_flight"):
        assert needle in proc.stderr, proc.stderr


def test_the_log_prob_audit_needs_a_tolerance_where_workers_hold_quantized_weights() -> None:
    audit = ["trainer.audit.logprob_rate=0.1"]
    assert load_config(None, audit).rollout_weights_are_a_cast  # bfloat16: the trainer casts as workers do
    with pytest.raises(ConfigError, match="trainer.audit.logprob_tolerance: required .*sync.dtype 'fp8_e4m3'"):
        load_config(None, [*audit, "sync.dtype=fp8_e4m3"])
    cfg = load_config(None, [*audit, "sync.dtype=fp8_e4m3", "trainer.audit.logprob_tolerance=0.3"])
    assert not cfg.rollout_weights_are_a_cast and cfg.trainer.audit.logprob_tolerance == 0.3
