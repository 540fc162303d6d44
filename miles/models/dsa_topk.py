"""One tie-break for the DSA indexer's top-k, so that the engine and the trainer select the same keys.

DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5.2) lets each query attend only to the ``index_topk`` keys its
indexer scores highest. A key's score is a weighted sum of ReLU'd per-head scores, so every key whose heads all
score at most 0 scores exactly ``0.0``, in any reduction order: exact ties are common (on a random-init twin a
query often has fewer positive-scoring keys than ``index_topk``, and the top-k boundary falls inside the zeros).
``torch.topk`` breaks ties in an unspecified way that depends on the row it is given: when the engine decodes
query ``t`` against its cache, transformers' indexer scores a row of ``t + 1`` keys; when the trainer scores the
whole sequence, query ``t``'s row has all ``S`` keys with the future at ``-inf``. The two calls pick different
tied keys, and the attention then differs by a whole key: on the GLM-5.2 twin a log-prob moved by 2e-2 (a
gap of 2.6e-4 at step 0 of its RL guard, averaged over the trained tokens). ``tests/unit/test_dsa_topk.py`` and
``tests/unit/test_engine_architectures.py`` reproduce it.

:func:`stabilize_dsa_topk` makes every DSA indexer of a model break ties by position (the earliest key wins),
a rule that depends only on the scores, so bit-identical scores select identical keys on both sides. Only the
top-k call inside the indexer's forward changes (a :class:`~torch.overrides.TorchFunctionMode` scoped to it),
so the scores themselves stay transformers' own. :func:`miles.models.loading.load_policy` applies it to every
model it loads (engines, trainer, teacher).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# transformers' DSA indexer classes (module class names, so that no model module has to be imported here).
DSA_INDEXERS = frozenset({"DeepseekV32Indexer", "GlmMoeDsaIndexer"})


def stable_topk(
    input: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True
) -> torch.return_types.topk:
    """``torch.topk`` whose ties go to the lowest index: a stable sort, cut at ``k``.

    The result is a function of the values alone (not of the tensor's shape or the kernel), which is what
    makes two computations of the same scores agree. Always sorted, which ``sorted=False`` also allows.
    """
    values, indices = torch.sort(input, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


class _StableTopkMode(TorchFunctionMode):
    """Within its scope, ``torch.topk`` and ``Tensor.topk`` are :func:`stable_topk`; every other call passes."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.topk or func is torch.Tensor.topk:
            return stable_topk(*args, **kwargs)
        return func(*args, **kwargs)


class StableTopkIndexer(nn.Module):
    """Mixin put in front of a DSA indexer's class: its forward runs under :class:`_StableTopkMode`.

    A class (not a wrapped bound method on the instance) so that ``copy.deepcopy`` of a model, as the FSDP
    backend does for its reference policy, gives indexers that call their own forward."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with _StableTopkMode():
            return super().forward(*args, **kwargs)


@functools.cache
def _stable_class(cls: type[nn.Module]) -> type[nn.Module]:
    return type(f"StableTopk{cls.__name__}", (StableTopkIndexer, cls), {"__module__": __name__})


def stabilize_dsa_topk(model: nn.Module) -> int:
    """Make every DSA indexer in ``model`` break top-k ties by position, in place; returns how many there are.

    Idempotent (an indexer already switched is counted and left alone); a model without DSA is untouched. A model
    whose config has ``index_topk`` but no indexer of a known class (a transformers release that renamed them)
    raises rather than run with the shape-dependent tie-break.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, StableTopkIndexer):
            count += 1
        elif type(module).__name__ in DSA_INDEXERS:
            module.__class__ = _stable_class(type(module))
            count += 1
    if count == 0 and getattr(getattr(model, "config", None), "index_topk", None) is not None:
        raise RuntimeError(
            f"{type(model).__name__} has a DSA config (index_topk) but none of the indexer classes "
            f"{sorted(DSA_INDEXERS)}: miles/models/dsa_topk.py must learn this transformers' indexer class"
        )
    return count
