"""HF <-> megatron-core converters, one module per architecture family behind one interface
(:class:`miles.backends.megatron.converters.base.Converter`). Adding an architecture: docs/megatron.md."""

from __future__ import annotations

from miles.backends.megatron.config import McoreModelArgs
from miles.backends.megatron.converters.base import Converter
from miles.backends.megatron.converters.deepseek import DeepseekConverter
from miles.backends.megatron.converters.llama import LlamaConverter
from miles.backends.megatron.converters.qwen3_moe import Qwen3MoeConverter

CONVERTERS: dict[str, type[LlamaConverter]] = {
    "llama": LlamaConverter,
    "qwen3_moe": Qwen3MoeConverter,
    "deepseek": DeepseekConverter,
}


def converter_for(args: McoreModelArgs, tensor_parallel: int = 1) -> Converter:
    """The converter of ``args.family`` (the family :func:`miles.backends.megatron.config.translate` chose)."""
    cls = CONVERTERS.get(args.family)
    if cls is None:
        raise KeyError(f"no converter for family '{args.family}' (known: {', '.join(sorted(CONVERTERS))})")
    return cls(args, tensor_parallel)


__all__ = ["CONVERTERS", "Converter", "converter_for"]
