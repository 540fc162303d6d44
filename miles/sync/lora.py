"""LoRA RL: adapters on a frozen base (trainer side) and applying a synced adapter (worker side).

Names. Adapter tensors travel under peft's saved-state names (those of ``get_peft_model_state_dict``):
``base_model.model.<module>.lora_A.weight`` (rank x in) and ``...lora_B.weight`` (out x rank), so a
payload published by Miles is a peft adapter any peft-aware tool (and SGLang's /load_lora_adapter)
can load. The base tensor an adapter modifies is ``<module>.weight`` in the HF state dict.

Applying. A worker computes ``W = W0 + (alpha / rank) * B @ A`` in float32 from the frozen base
``W0`` it captured before any adapter was applied, never from the weights currently in its engine:
an adapter is therefore never stacked on an earlier one (the silent "adapter merged into the base
twice" failure), and version ``v`` on a worker is exactly base + adapter ``v`` whatever it held before.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from miles.config import LoraConfig

PEFT_PREFIX = "base_model.model."
# A PeftModel's own state-dict keys carry the adapter name (".lora_A.default.weight"); saved ones do not.
_LIVE_KEY = re.compile(r"\.lora_([AB])\.[^.]+\.weight$")
_SAVED_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


def add_adapters(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Wrap ``model`` with fresh LoRA adapters (B = 0, so the policy is unchanged); the base is frozen."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, target_modules=list(cfg.target_modules), lora_dropout=0.0, bias="none"
    )
    wrapped = get_peft_model(model, peft_cfg)
    if not any(_LIVE_KEY.search(name) for name, _ in wrapped.named_parameters()):
        raise ValueError(f"trainer.lora.target_modules {cfg.target_modules} matched no linear layer of the model")
    return wrapped


def lora_scale(cfg: LoraConfig) -> float:
    return cfg.alpha / cfg.rank


def split_peft_state(state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A PeftModel's state dict -> (adapter under peft's saved names, base under HF names)."""
    adapter: dict[str, Tensor] = {}
    base: dict[str, Tensor] = {}
    for key, value in state.items():
        if not key.startswith(PEFT_PREFIX):
            raise ValueError(f"{key!r} is not a peft model key (expected the prefix {PEFT_PREFIX!r})")
        if _LIVE_KEY.search(key):
            adapter[_LIVE_KEY.sub(r".lora_\1.weight", key)] = value
        else:
            base[key[len(PEFT_PREFIX) :].replace(".base_layer.", ".")] = value
    return adapter, base


def adapter_pairs(adapter: Mapping[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """``{module: (A, B)}`` of an adapter under saved names; ``ValueError`` naming the key if malformed."""
    halves: dict[str, dict[str, Tensor]] = {}
    for key, value in adapter.items():
        match = _SAVED_KEY.match(key)
        if match is None:
            raise ValueError(f"adapter key {key!r} is not a LoRA tensor (base_model.model.<module>.lora_A/B.weight)")
        halves.setdefault(match["module"], {})[match["ab"]] = value
    pairs = {}
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter for {module!r} lacks lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter for {module!r}: A {tuple(a.shape)} and B {tuple(b.shape)} are not LoRA factors")
        pairs[module] = (a, b)
    if not pairs:
        raise ValueError("the adapter has no tensors")
    return pairs


def merge_adapter(
    base: Mapping[str, Tensor], adapter: Mapping[str, Tensor], scale: float, dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """``{module.weight: W0 + scale * B @ A}`` for the adapted modules only, computed in float32 and
    returned in ``dtype`` (default: the base tensor's)."""
    out = {}
    for module, (a, b) in adapter_pairs(adapter).items():
        key = f"{module}.weight"
        w0 = base.get(key)
        if w0 is None:
            raise ValueError(f"adapter targets {module!r}, but the base has no {key!r}")
        if tuple(w0.shape) != (b.shape[0], a.shape[1]):
            raise ValueError(
                f"adapter for {module!r} makes a {b.shape[0]}x{a.shape[1]} update for a base of {tuple(w0.shape)}"
            )
        merged = w0.float() + scale * (b.float() @ a.float())
        out[key] = merged.to(dtype or w0.dtype)
    return out


def merged_state(peft_state: Mapping[str, Tensor], scale: float) -> dict[str, Tensor]:
    """A PeftModel's state dict -> the equivalent plain HF state dict (adapters merged in)."""
    adapter, base = split_peft_state(peft_state)
    return base | merge_adapter(base, adapter, scale)


class AdapterApplier:
    """Worker side: turns each synced adapter into the merged tensors to stage in the engine.

    ``read_base`` returns the engine's current state dict; the base tensors of the adapted modules
    are captured from it (float32 copies) the first time a module is adapted, i.e. before any
    adapter touched it, and every later version is merged onto those copies.
    """

    def __init__(self, read_base: Callable[[], Mapping[str, Tensor]], scale: float) -> None:
        self._read_base = read_base
        self.scale = scale
        self._base: dict[str, Tensor] = {}

    def merged(self, adapter: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The adapted modules' weights for ``adapter`` (float32; the engine casts on apply)."""
        keys = [f"{module}.weight" for module in adapter_pairs(adapter)]
        missing = [k for k in keys if k not in self._base]
        if missing:
            live = self._read_base()
            for key in missing:
                if key not in live:
                    raise ValueError(f"adapter targets {key!r}, which the rollout model does not have")
                self._base[key] = live[key].detach().float().clone()
        return merge_adapter(self._base, adapter, self.scale, dtype=torch.float32)
