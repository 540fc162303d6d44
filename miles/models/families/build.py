"""Tiny twins on disk: tokenizer + config + seeded random weights of the family's class, built offline.

A twin directory is an ordinary HF checkpoint (``config.json``, safetensors, tokenizer files with the
chat template, ``generation_config.json`` whose EOS list is the family's stop ids), so
``miles.models.loading.load_policy`` / ``load_tokenizer`` and every engine load it like a real one.
As with :mod:`miles.models.tiny`, builds are keyed by a hash of everything that determines them and
renamed into place atomically, so concurrent processes of a run can all call :func:`build_tiny_twin`.
There is no SFT warm-up here: the twin is random-init; a warm-up, if any, is a separate preparation step.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import structlog

from miles.models.families.base import ModelFamily
from miles.models.families.config import FamilyModelConfig, TinyDims
from miles.models.families.registry import get_family
from miles.models.families.rules import stop_token_ids_for
from miles.models.families.tokenizer import CORPUS_VERSION, DEFAULT_VOCAB_SIZE, build_tokenizer
from miles.models.model_cache import BUILD_INFO_FILE, build_once, default_cache_dir, is_built

log = structlog.get_logger(__name__)

# Bump when the builder changes what it writes, to invalidate cached twins.
BUILD_FORMAT = 1


class CheckpointMismatchError(ValueError):
    """A full-size ``model.path`` that is missing or holds another family's checkpoint."""


class TwinNotBuiltError(FileNotFoundError):
    """A tiny twin that preparation has not built on this machine."""


def twin_cache_key(family: ModelFamily, dims: TinyDims, seed: int) -> str:
    """Stable short hash of what determines a twin: family data, dims, seed and the library versions.

    The versions are in because random init and (de)serialisation are theirs: a twin built under
    another torch or transformers is rebuilt rather than trusted to be bit-identical.
    """
    import tokenizers
    import torch
    import transformers

    chat = family.chat
    payload = {
        "format": BUILD_FORMAT,
        "family": family.name,
        "architecture": family.architecture,
        "config": family.tiny_kwargs(0, dims),
        "template": chat.template,
        "tokens": list(chat.all_tokens()),
        "corpus": CORPUS_VERSION,
        "vocab_size": DEFAULT_VOCAB_SIZE,
        "dims": dims.model_dump(mode="json"),
        "seed": seed,
        "versions": [torch.__version__, transformers.__version__, tokenizers.__version__],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_tiny_twin(family: ModelFamily, out_dir: Path, dims: TinyDims | None = None, seed: int = 0) -> dict[str, Any]:
    """Build the twin into ``out_dir`` (not atomic; see :func:`build_tiny_twin`) and return its build info."""
    import torch
    from transformers import AutoModelForCausalLM

    dims = dims or TinyDims()
    start = time.perf_counter()
    tokenizer = build_tokenizer(family)
    token_ids = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}
    config = family.tiny_config(len(tokenizer), dims, token_ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if type(model).__name__ != family.architecture:
        raise RuntimeError(f"{family.name}: built {type(model).__name__}, the family says {family.architecture}")
    stops = stop_token_ids_for(tokenizer, family)
    model.generation_config.eos_token_id = stops
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    info = {
        "key": twin_cache_key(family, dims, seed),
        "family": family.name,
        "architecture": family.architecture,
        "dims": dims.model_dump(mode="json"),
        "seed": seed,
        "vocab_size": len(tokenizer),
        "stop_token_ids": stops,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "build_s": round(time.perf_counter() - start, 3),
    }
    (out_dir / BUILD_INFO_FILE).write_text(json.dumps(info, indent=2))
    return info


def tiny_twin_dir(
    family: ModelFamily | str, root: str | Path | None = None, dims: TinyDims | None = None, seed: int = 0
) -> Path:
    """Where ``family``'s tiny twin is (or would be) cached; builds nothing."""
    family = get_family(family) if isinstance(family, str) else family
    root = Path(root).expanduser() if root is not None else default_cache_dir()
    return root / f"{family.name}-tiny-{twin_cache_key(family, dims or TinyDims(), seed)}"


def build_tiny_twin(
    family: ModelFamily | str, root: str | Path | None = None, dims: TinyDims | None = None, seed: int = 0
) -> Path:
    """Directory of ``family``'s tiny twin under ``root`` (default cache dir), building it on a cache miss.

    The build goes to a private temporary directory renamed into place, so a reader never sees a
    half-written twin even if the builder crashes.
    """
    family = get_family(family) if isinstance(family, str) else family
    dims = dims or TinyDims()
    final = tiny_twin_dir(family, root, dims, seed)
    info = build_once(final, lambda tmp: write_tiny_twin(family, tmp, dims, seed), "twin")
    if info is not None:
        params, seconds = info["num_parameters"], info["build_s"]
        log.info("tiny twin built", family=family.name, dir=str(final), params=params, s=seconds)
    return final


def resolve_family_dir(cfg: FamilyModelConfig, *, build: bool = True) -> Path:
    """The checkpoint directory for ``cfg``: the (cached) tiny twin, or the full-size ``path`` after checking
    that its ``config.json`` is of the family's model type (a wrong path must not load silently).

    ``build=False`` only locates the twin (actors load what preparation built; they never build it):
    :class:`TwinNotBuiltError` if it is not there."""
    family = get_family(cfg.family)
    if cfg.size == "tiny":
        if build:
            return build_tiny_twin(family, cfg.cache_dir, cfg.tiny, cfg.seed)
        path = tiny_twin_dir(family, cfg.cache_dir, cfg.tiny, cfg.seed)
        if not is_built(path):
            raise TwinNotBuiltError(
                f"the {family.display_name} tiny twin of this recipe is not built on this machine ({path}); run "
                "`miles prepare RECIPE` first (`miles run` does it for you)"
            )
        return path
    path = Path(cfg.path or "").expanduser()
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointMismatchError(f"model.path {str(path)!r} has no config.json (nothing is downloaded)")
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type not in family.checkpoint_model_types:
        raise CheckpointMismatchError(
            f"model.path {str(path)!r} holds a {model_type!r} checkpoint; {family.display_name} expects one of "
            f"{', '.join(family.checkpoint_model_types)}"
        )
    return path
