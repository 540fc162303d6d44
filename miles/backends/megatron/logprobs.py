"""Per-token log-probs and entropies from vocab-parallel logits, in chunks of tokens.

Each tensor-parallel rank holds the logits of its slice of the (padded) vocabulary. With ``z = logits / T``:
``logp(y) = z_y - logsumexp(z)`` and ``H = logsumexp(z) - sum softmax(z) * z``, where the max, the sum of
exponentials, the target logit and ``sum p * z`` are each reduced over the TP group. Every TP rank then
holds the same values and computes the same loss, so the reductions' backward is the identity (megatron's
convention for TP; a summing backward would scale gradients by the TP size).

Rows of the padded vocabulary (ids >= the real vocabulary size) are masked to ``-inf``: they are not
tokens, and their logits (from zero-initialised padding rows) would otherwise shift ``logsumexp``.

Chunks of ``chunk_tokens`` tokens are upcast to float32 one at a time; with gradients each chunk runs
under activation checkpointing, so the float32 ``(tokens, V / tp)`` copies are never held together.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint


class _ReduceSum(torch.autograd.Function):
    """All-reduce (sum) over ``group`` forward, identity backward."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup | None) -> Tensor:  # type: ignore[override]
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def _reduce_sum(x: Tensor, group: dist.ProcessGroup | None, size: int) -> Tensor:
    return _ReduceSum.apply(x, group) if size > 1 else x


def _chunk_stats(
    logits: Tensor,  # (N, Vl) any float dtype
    targets: Tensor,  # (N,) long, global ids
    vocab_start: int,
    vocab_size: int,
    temperature: float,
    group: dist.ProcessGroup | None,
    size: int,
    want_entropy: bool,
) -> tuple[Tensor, Tensor]:
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    ids = torch.arange(vocab_start, vocab_start + z.shape[-1], device=z.device)
    padding = ids >= vocab_size  # (Vl,)
    if bool(padding.any()):
        z = z.masked_fill(padding, float("-inf"))
    peak = z.detach().max(dim=-1).values  # (N,)
    if size > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = z - peak.unsqueeze(-1)  # (N, Vl), <= 0
    exp = shifted.exp()
    total = _reduce_sum(exp.sum(dim=-1), group, size)  # (N,)
    lse = peak + total.log()  # (N,)
    local = (targets >= vocab_start) & (targets < vocab_start + z.shape[-1])
    index = (targets - vocab_start).clamp(0, z.shape[-1] - 1)
    picked = z.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(~local, 0.0)  # (N,)
    logp = _reduce_sum(picked, group, size) - lse
    if not want_entropy:
        return logp, logp.new_zeros(())
    probs = exp / total.unsqueeze(-1)  # (N, Vl)
    finite = z.masked_fill(padding, 0.0) if bool(padding.any()) else z  # p = 0 there; 0 * -inf would be NaN
    pz = (probs * finite).sum(dim=-1)
    entropy = lse - _reduce_sum(pz, group, size)
    return logp, entropy


def vocab_parallel_logprobs(
    logits: Tensor,  # (B, S, V / tp)
    targets: Tensor,  # (B, S) long
    *,
    vocab_size: int,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_tokens: int = 4096,
    group: dist.ProcessGroup | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``(logp, entropy or None)``, each ``(B, S)`` float32, the same on every rank of the TP ``group``.

    ``vocab_size`` is the real vocabulary (the logits may carry padding columns). ``group=None`` with no
    process group joined means TP = 1.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if size > 1 else 0
    local_vocab = logits.shape[-1]
    vocab_start = rank * local_vocab
    batch, seq = targets.shape
    flat_logits = logits.reshape(batch * seq, local_vocab)
    flat_targets = targets.reshape(batch * seq)
    logps, entropies = [], []
    for start in range(0, batch * seq, chunk_tokens):
        piece = (flat_logits[start : start + chunk_tokens], flat_targets[start : start + chunk_tokens])
        args = (vocab_start, vocab_size, temperature, group, size, entropy)
        if torch.is_grad_enabled() and logits.requires_grad:
            lp, ent = checkpoint(_chunk_stats, *piece, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(*piece, *args)
        logps.append(lp)
        entropies.append(ent)
    logp = torch.cat(logps).reshape(batch, seq)
    return logp, (torch.cat(entropies).reshape(batch, seq) if entropy else None)
