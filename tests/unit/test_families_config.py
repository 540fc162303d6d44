"""The family ``model:`` section and the recipes under recipes/models: they validate, and what they claim holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from pydantic import ValidationError
from torch import nn
from transformers import AutoModelForCausalLM

from miles.config import RunConfig
from miles.models.families import FamilyModelConfig, family_names, get_family
from miles.models.families.build import CheckpointMismatchError, build_tiny_twin, resolve_family_dir

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "models"


class FamilyRunConfig(RunConfig):
    """RunConfig with the family model section, as miles/config.py will have it once the union is wired."""

    model: FamilyModelConfig  # type: ignore[assignment]


def _load(path: Path) -> FamilyRunConfig:
    return FamilyRunConfig.model_validate(yaml.safe_load(path.read_text()))


def test_every_family_has_a_full_and_a_tiny_recipe() -> None:
    names = {p.stem for p in RECIPES.glob("*.yaml")}
    assert names == {n for f in family_names() for n in (f, f"{f}-tiny")}


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_recipe_validates_and_matches_its_family(path: Path) -> None:
    cfg = _load(path)
    family = get_family(cfg.model.family)
    assert path.stem.removesuffix("-tiny") == family.name
    if path.stem.endswith("-tiny"):
        assert cfg.model.size == "tiny"
        assert (cfg.rollout.engine.type, cfg.trainer.backend.type) == ("torch", "fsdp")
        assert cfg.trainer.steps <= 5 and cfg.task.type == "arithmetic"
    else:
        assert cfg.model.size == "full" and cfg.model.variant in family.variants
        assert (cfg.rollout.engine.type, cfg.trainer.backend.type) == ("sglang", "megatron")
        assert path.read_text().startswith(f"# {family.display_name} full size")
    if cfg.trainer.lora is not None:  # a recipe's LoRA targets are its family's
        assert cfg.trainer.lora.target_modules == list(family.lora.modules)
        assert cfg.sync.mode == "lora"


def _lora_bytes(name: str, rank: int) -> float:
    """BF16 bytes of a rank-``rank`` adapter on the family's LoRA targets at full size (meta device)."""
    family = get_family(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(family.full_config())
    params = sum(
        rank * (m.in_features + m.out_features)
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n.split(".")[-1] in family.lora.modules
    )
    return 2.0 * params


@pytest.mark.parametrize(("name", "megabytes"), [("glm52", 212), ("deepseek_v32", 194), ("kimi_k26", 122)])
def test_full_recipe_adapter_size(name: str, megabytes: int) -> None:
    """The recipes' adapter sizes; GLM-5.2's rank-16 MLA adapter is the reference's 212 MB (0.014% of the base)."""
    cfg = _load(RECIPES / f"{name}.yaml")
    assert cfg.trainer.lora is not None
    size_mb = _lora_bytes(name, cfg.trainer.lora.rank) / 1e6
    assert abs(size_mb - megabytes) / megabytes < 0.02, size_mb


def test_config_errors_name_the_problem() -> None:
    with pytest.raises(ValidationError, match="unknown model family 'llama'"):
        FamilyModelConfig(family="llama")
    with pytest.raises(ValidationError, match="needs model.path"):
        FamilyModelConfig(family="glm52", size="full")
    with pytest.raises(ValidationError, match="not a gpt_oss variant"):
        FamilyModelConfig(family="gpt_oss", variant="7b")
    with pytest.raises(ValidationError, match="only read for model.size 'full'"):
        FamilyModelConfig(family="gpt_oss", path="/models/x")
    with pytest.raises(ValidationError, match="experts_per_token"):
        FamilyModelConfig(family="qwen38", tiny={"num_experts": 2, "experts_per_token": 4})
    with pytest.raises(ValidationError, match="Extra inputs"):
        FamilyModelConfig(family="qwen38", hidden_size=64)


def test_resolve_family_dir_builds_tiny_and_checks_full_checkpoints(tmp_path: Path) -> None:
    twin = resolve_family_dir(FamilyModelConfig(family="kimi_k26", cache_dir=str(tmp_path)))
    assert twin == build_tiny_twin("kimi_k26", tmp_path)
    # A twin is a valid checkpoint of its family (Kimi accepts deepseek_v3 text checkpoints) ...
    assert resolve_family_dir(FamilyModelConfig(family="kimi_k26", size="full", path=str(twin))) == twin
    # ... and of no other: a wrong path must not load silently as another model.
    with pytest.raises(CheckpointMismatchError, match="holds a 'deepseek_v3' checkpoint"):
        resolve_family_dir(FamilyModelConfig(family="glm52", size="full", path=str(twin)))
    with pytest.raises(CheckpointMismatchError, match="no config.json"):
        resolve_family_dir(FamilyModelConfig(family="glm52", size="full", path=str(tmp_path / "missing")))
    assert json.loads((twin / "config.json").read_text())["model_type"] == "deepseek_v3"
