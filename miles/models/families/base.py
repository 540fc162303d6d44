"""What differs from one model family to the next, as data: one :class:`ModelFamily` per family module.

Why data and not code paths: the engine, the trainer, weight sync and the tokenizer builder each need a
handful of per-family facts (stop tokens, LoRA targets, which tensors quantize and how, how experts are
laid out). Keeping them in one frozen record per family means adding a family is one module plus a
recipe, and every consumer reads the same answer. Nothing here imports torch or transformers at module
import time, so the config layer can validate a family name instantly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from miles.models.families.config import TinyDims

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """Tokenizer-level facts: the chat template, the special tokens and how a turn ends.

    ``special_tokens`` are control tokens (single ids, dropped by ``skip_special_tokens``);
    ``added_tokens`` are single ids that are still text (think and tool tags, as the real tokenizers
    have them). ``end_of_turn`` is the token that closes an assistant turn in the rendered history;
    ``None`` means the next role marker closes it (GLM), so an agent loop that appends the next turn
    must not emit that marker twice.
    """

    template: str
    bos: str | None
    eos: str
    pad: str
    special_tokens: tuple[str, ...]
    stop_tokens: tuple[str, ...]
    end_of_turn: str | None
    reasoning: str
    tool_calls: str
    added_tokens: tuple[str, ...] = ()
    notes: str = ""

    def all_tokens(self) -> tuple[str, ...]:
        """Every token the tokenizer must hold as one id, specials first, deduplicated, in a stable order."""
        named = [t for t in (self.bos, self.eos, self.pad) if t is not None]
        return tuple(dict.fromkeys([*named, *self.special_tokens, *self.stop_tokens, *self.added_tokens]))


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """A weight format: codes, scales and the block a scale covers, as ``(rows, cols)`` of one matrix.

    Rows run along the output features and columns along the input (contraction) features of the
    matrix a tensor stores (of each expert, for 3-D tensors). ``(0, 0)`` means one scale per tensor.
    ``native`` says whether the family's released checkpoint ships in this format.
    """

    name: str
    codes: str
    scales: str
    block: tuple[int, int]
    native: bool

    @property
    def per_tensor(self) -> bool:
        return self.block == (0, 0)


FP8_BLOCK128 = QuantFormat(
    name="fp8_block128",
    codes="float8_e4m3fn",
    scales="float32 weight_scale_inv per 128x128 block (ceil-divided at the edges)",
    block=(128, 128),
    native=True,
)
MXFP4 = QuantFormat(
    name="mxfp4",
    codes="float4_e2m1 packed two per byte (*_blocks, uint8)",
    scales="e8m0 (*_scales, uint8) per 32 input features",
    block=(1, 32),
    native=True,
)
INT4_G32 = QuantFormat(
    name="int4_g32",
    codes="int4 symmetric, packed eight per int32 (compressed-tensors pack-quantized)",
    scales="bfloat16 per 32 input features",
    block=(1, 32),
    native=True,
)
FP8_TENSOR = QuantFormat(
    name="fp8_tensor",
    codes="float8_e4m3fn",
    scales="float32 power-of-two scale per tensor (Miles' own codec, miles/sync/quant.py)",
    block=(0, 0),
    native=False,
)


@dataclass(frozen=True, slots=True)
class QuantRule:
    """Which tensors quantize, and in which format.

    ``linear`` applies to 2-D ``*.weight`` tensors of linear layers, ``experts`` to the fused 3-D expert
    tensors (``(E, ., .)``, no ``.weight`` suffix); ``None`` keeps them in bf16. A name matching any
    ``exclude`` regex (``re.search``) never quantizes: embeddings, the unembedding, norms, routers and
    small projections whose precision matters more than their bytes.
    """

    linear: QuantFormat | None
    experts: QuantFormat | None
    exclude: tuple[str, ...]
    notes: str = ""


COMMON_EXCLUDE: tuple[str, ...] = (r"embed", r"lm_head", r"norm", r"\.bias$", r"_bias$")


@dataclass(frozen=True, slots=True)
class MoeLayout:
    """How the experts sit in memory (transformers' fused layout) and in the released checkpoint.

    ``weight_layout`` is the order of the two matrix axes after the expert axis: ``out_in`` is
    ``(E, out, in)`` as in ``nn.Linear``; ``in_out`` is ``(E, in, out)`` (GPT-OSS). ``gate_up`` says
    whether gate and up are the two halves of ``gate_up_proj`` (``concat``) or alternate (``interleaved``).
    ``checkpoint_experts`` is how ``save_pretrained`` writes them: ``per_expert`` 2-D tensors
    (``experts.<e>.gate_proj.weight``) that transformers fuses on load, or already ``fused``.
    """

    experts_module: str
    weight_layout: Literal["out_in", "in_out"]
    gate_up: Literal["concat", "interleaved"]
    checkpoint_experts: Literal["per_expert", "fused"]
    router: str
    shared_experts: str | None
    dense_layers: str
    fused_tensors: tuple[str, ...] = ("gate_up_proj", "down_proj")
    notes: str = ""

    @property
    def in_axis(self) -> int:
        """Axis of a fused 3-D expert tensor that runs along the input (contraction) features."""
        return 2 if self.weight_layout == "out_in" else 1


@dataclass(frozen=True, slots=True)
class LoraTargets:
    """peft targets: ``modules`` are ``nn.Linear`` name suffixes (``target_modules``); ``expert_parameters``
    are fused 3-D expert parameters peft can adapt through ``target_parameters`` (opt-in: large, and the
    rollout engine must support adapters on experts)."""

    modules: tuple[str, ...]
    expert_parameters: tuple[str, ...] = ()
    notes: str = ""


@dataclass(frozen=True)
class ModelFamily:
    """One model family: architecture, full-size variants, tiny twin, chat format, LoRA, quantization, MoE.

    ``variants`` maps a variant name to the kwargs of its real (full-size) config, and
    ``published_params_b`` to its published (total, active) size in billions of parameters, against
    which the test-suite checks the config on the meta device. ``tiny_kwargs`` maps ``(vocab_size,
    dims)`` to the kwargs of the tiny twin's config of the same class; token ids (bos, eos, pad) are set
    from the tokenizer by :meth:`tiny_config`.
    """

    name: str
    display_name: str
    architecture: str
    model_type: str
    checkpoint_model_types: tuple[str, ...]
    class_note: str
    attention: str
    variants: Mapping[str, Mapping[str, Any]]
    default_variant: str
    tiny_kwargs: Callable[[int, TinyDims], dict[str, Any]]
    chat: ChatFormat
    lora: LoraTargets
    quant: QuantRule
    moe: MoeLayout | None
    published_params_b: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    notes: str = ""
    variant_notes: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.default_variant not in self.variants:
            raise ValueError(f"{self.name}: default variant {self.default_variant!r} is not among its variants")
        if set(self.published_params_b) != set(self.variants):
            raise ValueError(f"{self.name}: published_params_b must give (total, active) for every variant")

    def full_config(self, variant: str | None = None) -> PretrainedConfig:
        """The real architecture config of ``variant`` (default: :attr:`default_variant`)."""
        from transformers import AutoConfig

        name = variant or self.default_variant
        if name not in self.variants:
            raise ValueError(f"{self.name} has no variant {name!r} (one of {', '.join(self.variants)})")
        return AutoConfig.for_model(self.model_type, **dict(self.variants[name]))

    def tiny_config(
        self, vocab_size: int, dims: TinyDims | None = None, token_ids: Mapping[str, int | None] | None = None
    ) -> PretrainedConfig:
        """The tiny twin's config: the same architecture class, tiny dims, the tokenizer's special ids."""
        from transformers import AutoConfig

        kwargs = self.tiny_kwargs(vocab_size, dims or TinyDims())
        kwargs.update({f"{k}_token_id": v for k, v in (token_ids or {}).items()})
        return AutoConfig.for_model(self.model_type, **kwargs)
