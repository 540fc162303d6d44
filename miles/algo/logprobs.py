"""Per-token log-probabilities and entropies from logits.

Both are computed from ``logsumexp`` instead of a full ``log_softmax`` so that only one extra
``(B, T)`` tensor is materialised next to the ``(B, T, V)`` logits, which dominate memory for real
vocabularies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.utils.checkpoint
from torch import Tensor


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of each target token.

    Args:
        logits: ``(B, T, V)`` next-token logits; position ``t`` predicts ``targets[:, t]``.
        targets: ``(B, T)`` token ids.
        temperature: logits are divided by it first, so the result matches an engine that sampled
            at that temperature (the behaviour log-probs are reported that way).

    Returns:
        ``(B, T)`` float32 log-probs.
    """
    logits = _scaled(logits, temperature)  # (B, T, V)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of each next-token distribution: ``logsumexp(z) - sum(softmax(z) * z)``, ``(B, T, V) -> (B, T)``."""
    logits = _scaled(logits, temperature)  # (B, T, V)
    probs = torch.softmax(logits, dim=-1)  # (B, T, V)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def _scaled(logits: Tensor, temperature: float) -> Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


Head = Callable[[Tensor], Tensor]  # (n, H) hidden states -> (n, V) logits (an lm_head, LoRA-wrapped or not)


def _chunk_scores(
    hidden: Tensor, targets: Tensor, head: Head, temperature: float, softcap: float | None, with_entropy: bool
) -> tuple[Tensor, Tensor]:
    """Log-prob of each target (and entropy) for a chunk of positions: ``(n, H) -> (n,), (n,)``."""
    logits = head(hidden).float()  # (n, V): the only vocabulary-sized tensor, one chunk at a time
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = _scaled(logits, temperature)
    lse = torch.logsumexp(logits, dim=-1)  # (n,)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp, logp.new_zeros(())
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)  # (n,)
    return logp, entropy


def chunked_logprobs(
    hidden: Tensor,
    head: Head,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    softcap: float | None = None,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Per-position log-prob of ``targets`` under ``softmax(softcap(head(hidden)) / T)``, in chunks.

    Args:
        hidden: ``(N, H)`` final hidden states (after the last norm).
        head: the unembedding, called on ``(chunk, H)`` slices (the model's ``lm_head`` module, so that a
            LoRA adapter on it takes part).
        targets: ``(N,)`` token ids.
        chunk_tokens: positions whose ``(chunk, V)`` float32 logits exist at once. With gradients each chunk
            is recomputed in backward (activation checkpointing), so a real vocabulary's logits are never
            held for a whole batch: memory is ``chunk * V`` floats instead of ``N * V``.
        softcap: final-logit soft-capping ``tanh(z / c) * c`` (Gemma); None for none.

    Returns:
        ``(logp, entropy)``, each ``(N,)`` float32; ``entropy`` is None unless ``with_entropy``.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} do not match")
    grad = torch.is_grad_enabled()
    logps: list[Tensor] = []
    entropies: list[Tensor] = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        args = (hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens], head)
        if grad:
            logp, entropy = torch.utils.checkpoint.checkpoint(
                _chunk_scores, *args, temperature, softcap, with_entropy, use_reentrant=False
            )
        else:
            logp, entropy = _chunk_scores(*args, temperature, softcap, with_entropy)
        logps.append(logp)
        entropies.append(entropy)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(logps), (torch.cat(entropies) if with_entropy else None)
