"""The three questions the runtime asks a family: when does generation stop, what does LoRA adapt, what quantizes.

Each answer is derived from the family's data (:mod:`miles.models.families.base`) and checked against
the real objects (the tokenizer's vocabulary, a tensor's name and shape), so that a family record that
does not fit its checkpoint fails loudly instead of silently generating past a turn or skipping experts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from miles.models.families.base import ModelFamily, QuantFormat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class _Shaped(Protocol):
    """What :func:`quantizable` reads from a tensor (a torch tensor, a meta tensor, a safetensors slice)."""

    @property
    def shape(self) -> Any: ...


class MissingStopTokenError(ValueError):
    """A family stop token the tokenizer cannot encode as one id: generation would run past the turn."""


def stop_token_ids_for(tokenizer: PreTrainedTokenizerBase, family: ModelFamily) -> list[int]:
    """The tokenizer's EOS id(s), then the ids of the family's stop tokens; deduplicated, EOS first.

    Raises :class:`MissingStopTokenError` if a stop token is not a single token of the vocabulary
    (for example a checkpoint of another family, or a tokenizer whose template tokens were not added).
    """
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    if isinstance(eos, int):
        ids.append(eos)
    elif isinstance(eos, list):
        ids.extend(int(i) for i in eos)
    vocab = tokenizer.get_vocab()
    missing = [token for token in family.chat.stop_tokens if token not in vocab]
    if missing:
        raise MissingStopTokenError(
            f"{family.display_name} stop tokens {missing} are not single tokens of this tokenizer "
            f"(is it a {family.display_name} tokenizer?)"
        )
    ids.extend(int(vocab[token]) for token in family.chat.stop_tokens)
    return list(dict.fromkeys(ids))


def lora_targets(family: ModelFamily, *, experts: bool = False) -> dict[str, list[str]]:
    """peft targets of ``family``: ``{"target_modules": [...]}``, plus ``"target_parameters"`` for the fused
    3-D experts when ``experts`` is set (opt-in: see :class:`~miles.models.families.base.LoraTargets`)."""
    out = {"target_modules": list(family.lora.modules)}
    if experts:
        if not family.lora.expert_parameters:
            raise ValueError(f"{family.display_name} has no fused expert parameters to adapt")
        out["target_parameters"] = list(family.lora.expert_parameters)
    return out


@dataclass(frozen=True, slots=True)
class QuantTarget:
    """How one tensor quantizes: its format, and which axis runs along the input (contraction) features.

    ``format.block`` is ``(output, input)`` features of each matrix; the input features are on ``in_axis``
    (1 for a 2-D linear weight, 2 for ``(E, out, in)`` experts, 1 for GPT-OSS's ``(E, in, out)``) and the
    output features on the other matrix axis. A quantizer blocks each expert of a ``fused_experts`` tensor
    separately (scales gain the leading expert axis).
    """

    format: QuantFormat
    in_axis: int
    fused_experts: bool


def _is_fused_expert(name: str, family: ModelFamily) -> bool:
    moe = family.moe
    if moe is None:
        return False
    suffixes = [f"{moe.experts_module}.{t}" for t in moe.fused_tensors]
    return any(name == s or name.endswith("." + s) for s in suffixes)


def quantizable(name: str, tensor: _Shaped, family: ModelFamily) -> QuantTarget | None:
    """The format ``tensor`` (its state-dict ``name``) takes under ``family``'s rule, or None (stays bf16).

    Fused 3-D experts (``...<experts_module>.gate_up_proj`` / ``down_proj``) follow ``quant.experts``;
    2-D ``*.weight`` tensors follow ``quant.linear``; other shapes (conv kernels, sinks, scalars) never
    quantize. Group formats need the input axis to be a whole number of groups; block formats are
    ceil-divided at the edges (as DeepSeek's checkpoints are).
    """
    rule = family.quant
    if any(re.search(pattern, name) for pattern in rule.exclude):
        return None
    is_floating_point = getattr(tensor, "is_floating_point", None)
    if callable(is_floating_point) and not is_floating_point():
        return None
    shape = tuple(int(s) for s in tensor.shape)
    if _is_fused_expert(name, family) and len(shape) == 3:
        fmt, in_axis, fused = rule.experts, family.moe.in_axis, True  # type: ignore[union-attr]
    elif name.endswith(".weight") and len(shape) == 2:
        fmt, in_axis, fused = rule.linear, 1, False
    else:
        return None
    if fmt is None:
        return None
    is_group = fmt.block[0] == 1
    if is_group and shape[in_axis] % fmt.block[1]:
        return None
    return QuantTarget(format=fmt, in_axis=in_axis, fused_experts=fused)
