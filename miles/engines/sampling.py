"""Drawing one token per row of a batch whose rows have their own sampling parameters.

Each row brings its own uniform number (drawn from its request's own generator), and the token is
found by inverting the cumulative distribution. Why not ``torch.multinomial`` over the batch: its
draws depend on which other rows share the batch, so under continuous batching a seeded request
would sample differently depending on timing. With per-request uniforms a request's samples depend
only on its seed, the weights and its own tokens.
"""

from __future__ import annotations

import torch


def sample_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its behaviour log-prob.

    ``logits`` (B, V); ``temperature`` (B,), 0 meaning greedy; ``top_p`` (B,) in (0, 1]; ``uniforms``
    (B,) in (0, 1]. Returns tokens (B,) and log-probs (B,).

    The log-prob is taken under ``log_softmax(logits / T)`` (``T = 1`` for greedy rows), *before* top-p
    truncation: the distribution importance ratios are computed against. Greedy rows take the argmax.
    """
    logits = logits.float()  # (B, V)
    greedy = temperature == 0  # (B,)
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).to(logits)  # (B,)
    logp = torch.log_softmax(logits / scale.unsqueeze(-1), dim=-1)  # (B, V)
    drawn = _inverse_cdf(logp.exp(), top_p.to(logits), uniforms.to(logits))  # (B,)
    tokens = torch.where(greedy, logits.argmax(dim=-1), drawn)  # (B,)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _inverse_cdf(probs: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token ids (B,) drawn from ``probs`` (B, V) truncated to each row's top-p nucleus, by inversion.

    The nucleus is the smallest set of most likely tokens whose mass reaches ``top_p`` (the top token is
    always in it; tokens tied with its least likely member are kept too). The inversion runs over the
    vocabulary in id order whatever the other rows need, so a row's token depends only on its own
    distribution and uniform. ``uniforms`` in (0, 1] (never 0: a zero-probability token is never picked).
    """
    if bool((top_p < 1.0).any()):
        ranked = probs.sort(dim=-1, descending=True).values  # (B, V)
        inside = (ranked.cumsum(dim=-1) - ranked) < top_p.unsqueeze(-1)  # (B, V): mass before it < top_p
        smallest = ranked.masked_fill(~inside, float("inf")).min(dim=-1).values  # (B,): least likely kept
        floor = torch.where(top_p < 1.0, smallest, torch.zeros_like(smallest))  # (B,): 0 keeps everything
        probs = probs.masked_fill(probs < floor.unsqueeze(-1), 0.0)
    cdf = probs.cumsum(dim=-1)  # (B, V), non-decreasing
    target = (uniforms * cdf[:, -1]).unsqueeze(-1)  # (B, 1), in (0, kept mass]
    return torch.searchsorted(cdf, target).squeeze(-1).clamp(max=probs.shape[-1] - 1)  # (B,)
