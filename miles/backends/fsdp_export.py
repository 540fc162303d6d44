"""Full tensors of an FSDP2-sharded model, one parameter at a time, under Hugging Face names.

What :meth:`miles.backends.base.TrainBackend.export_params` needs from an FSDP2 model. The old export
(``get_model_state_dict(full_state_dict=True)``) gathered every parameter to rank 0 before the first byte
left it, so rank 0 briefly held the whole model twice (shards + full copy). Here each DTensor is gathered
(``full_tensor()``, an all-gather over the mesh) only when it is yielded and dropped by the consumer before
the next one, so a rank's peak is its shards plus one full parameter, whatever the model size.

Order and names:

* Tensors come in byte-wise sorted name order, the order the streamed payload is written in
  (:mod:`miles.sync.stream_export`), so the writer never waits for a tensor it has to buffer. The order
  depends on the module structure only: every rank iterates the same sequence, which is what makes the
  per-parameter all-gathers line up. **Every rank must iterate to the end** (``stream_export.drain``).
* Names are the state-dict keys of the HF model (persistent buffers included). Tied parameters (an
  ``lm_head`` sharing the embedding) are exported once, under the first key that names them, which is
  what ``save_pretrained`` does too; the engines accept a tied tensor given once.
* A peft model (LoRA): ``adapter_only`` exports the adapter under peft's *saved* names
  (``base_model.model.<module>.lora_A.weight``); otherwise the base under HF names with the adapters merged
  in (``W0 + scale * B @ A``, exactly :func:`miles.sync.lora.merge_adapter`), i.e. the policy as a plain HF
  model. The base of a peft model is never exported without merging: that would silently drop the policy.

Tensors are float32 (integer buffers keep their dtype) on CPU. When the model is not sharded (one process,
no process group) a yielded tensor may be the live parameter itself, not a copy: consume it before the next
optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from miles.sync.lora import PEFT_PREFIX, merge_adapter, split_peft_state
from miles.sync.stream_export import TensorSpec

try:  # torch >= 2.4 exports DTensor publicly
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch
    from torch.distributed._tensor import DTensor  # type: ignore[no-redef]


@dataclass(frozen=True, slots=True)
class _Entry:
    """One exported tensor: its name and the live tensors it is computed from (a LoRA merge needs three)."""

    name: str
    source: Tensor
    lora_a: Tensor | None = None
    lora_b: Tensor | None = None


def _state_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The model's state-dict tensors by key, live (no copy, no gather), tied duplicates dropped."""
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue  # a tied parameter: exported under its first key, as save_pretrained does
        seen.add(id(tensor))
        out[key] = tensor
    return out


def _is_peft(state: dict[str, Tensor]) -> bool:
    return bool(state) and all(key.startswith(PEFT_PREFIX) for key in state)


def _entries(model: nn.Module, *, adapter_only: bool, lora_scale: float | None) -> list[_Entry]:
    state = _state_tensors(model)
    if not _is_peft(state):
        if adapter_only:
            raise ValueError("adapter_only export needs a peft (LoRA) model")
        return [_Entry(name, state[name]) for name in sorted(state)]
    adapter, base = split_peft_state(state)
    if adapter_only:
        return [_Entry(name, adapter[name]) for name in sorted(adapter)]
    if lora_scale is None:
        raise ValueError("exporting the base of a LoRA model needs lora_scale, to merge the adapters in")
    entries = []
    for name in sorted(base):
        module = name.removesuffix(".weight")
        a = adapter.get(f"{PEFT_PREFIX}{module}.lora_A.weight")
        b = adapter.get(f"{PEFT_PREFIX}{module}.lora_B.weight")
        if (a is None) != (b is None):
            raise ValueError(f"{module}: LoRA adapter has only one of lora_A / lora_B")
        entries.append(_Entry(name, base[name], a, b))
    return entries


def _out_dtype(tensor: Tensor) -> torch.dtype:
    return torch.float32 if tensor.is_floating_point() else tensor.dtype


def export_specs(model: nn.Module, *, adapter_only: bool = False, lora_scale: float | None = None) -> list[TensorSpec]:
    """Name, dtype and full shape of every tensor :func:`iter_full_params` yields, in its order, without any
    collective: what the streamed payload's header is computed from. Local (any rank may call it alone)."""
    return [
        TensorSpec(e.name, _out_dtype(e.source), tuple(e.source.shape))
        for e in _entries(model, adapter_only=adapter_only, lora_scale=lora_scale)
    ]


def _full(tensor: Tensor) -> Tensor:
    """The whole tensor on this rank: an all-gather for a DTensor (collective), the tensor itself otherwise."""
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return full.detach()


def iter_full_params(
    model: nn.Module,
    *,
    adapter_only: bool = False,
    lora_scale: float | None = None,
    dst: int | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """``(name, full float32 CPU tensor)`` one at a time, in sorted name order. Collective: see the module
    docstring (every rank iterates to the end, in lockstep).

    ``dst``: the rank that consumes the tensors; the others get empty tensors (they still take part in every
    gather, and drop the result at once). ``None``: every rank gets every tensor.
    """
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    keep = dst is None or rank == dst
    with torch.no_grad():
        for entry in _entries(model, adapter_only=adapter_only, lora_scale=lora_scale):
            full = _full(entry.source)
            if entry.lora_a is not None and entry.lora_b is not None:
                a, b = _full(entry.lora_a), _full(entry.lora_b)
                module = entry.name.removesuffix(".weight")
                pair = {f"{PEFT_PREFIX}{module}.lora_A.weight": a, f"{PEFT_PREFIX}{module}.lora_B.weight": b}
                full = merge_adapter({entry.name: full.float()}, pair, lora_scale or 0.0)[entry.name]
                del a, b
            dtype = _out_dtype(full)
            if not keep:
                del full  # gathered for the collective only
                yield entry.name, torch.empty(0, dtype=dtype)
                continue
            full = full.to(device="cpu", dtype=dtype)
            yield entry.name, full
            del full  # before the next gather: one full parameter at a time
