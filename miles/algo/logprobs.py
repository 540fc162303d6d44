"""Per-token log-probabilities and entropies from logits.

Both are computed from ``logsumexp`` instead of a full ``log_softmax`` so that only one extra
``(B, T)`` tensor is materialised next to the ``(B, T, V)`` logits, which dominate memory for real
vocabularies.
"""

from __future__ import annotations

import torch
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
