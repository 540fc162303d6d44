"""HF <-> megatron-core converters, one module per architecture family behind one interface
(:class:`miles.backends.megatron.converters.base.Converter`). Adding an architecture: docs/megatron.md."""

from __future__ import annotations

from miles.backends.megatron.config import McoreModelArgs
from miles.backends.megatron.converters.base import Converter
from miles.backends.megatron.converters.deepseek import DeepseekConverter
from miles.backends.megatron.converters.llama import LlamaConverter
from miles.backends.megatron.converters.qwen3_moe import Qwen3MoeConverter
from miles.plugins import Registry

CONVERTERS: Registry[Converter] = Registry("megatron converter")  # factory(args, tensor_parallel)
for _name, _cls in {"llama": LlamaConverter, "qwen3_moe": Qwen3MoeConverter, "deepseek": DeepseekConverter}.items():
    CONVERTERS.register(_name)(_cls)


def converter_for(args: McoreModelArgs, tensor_parallel: int = 1) -> Converter:
    """The converter of ``args.family`` (the family :func:`miles.backends.megatron.config.translate` chose)."""
    return CONVERTERS.factory(args.family)(args, tensor_parallel)


__all__ = ["CONVERTERS", "Converter", "converter_for"]
