"""Embedded generation engine: our own batched KV-cache sampling loop over an HF causal LM.

Why not ``model.generate``: we need the exact behaviour log-prob of every sampled token and
control at every token boundary (weights are swapped between steps by a later feature), both of
which are awkward through the generic generation API. The loop is short: one prefill of the
left-padded batch, then one single-token forward per step with the cache.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Mapping
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from miles.config import TorchEngineConfig
from miles.engines.base import Generation, SamplingParams
from miles.models.loading import to_torch_dtype


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits`` (B, V); return the tokens (B,) and their log-probs (B,).

    The log-prob is taken under ``log_softmax(logits / T)`` (``T = 1`` when greedy), before top-p
    truncation: that is the behaviour distribution importance ratios are computed against.
    """
    logits = logits.float()
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)  # (B, V)
        tokens = logits.argmax(dim=-1)  # (B,)
    else:
        logp = torch.log_softmax(logits / params.temperature, dim=-1)  # (B, V)
        probs = logp.exp()  # (B, V)
        if params.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)  # (B, V)
            # Keep the smallest prefix whose mass reaches top_p (the top token is always kept).
            drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= params.top_p  # (B, V)
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _forward_kwargs(model: PreTrainedModel) -> tuple[str, dict[str, Any]]:
    """The forward kwarg that takes the KV cache and the extras that skip unneeded logits.

    transformers renamed both over time (``past_key_values`` -> ``cache``, ``num_logits_to_keep`` ->
    ``logits_to_keep``); we ask the signature rather than pin a version.
    """
    params = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    extra: dict[str, Any] = {"use_cache": True}
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            extra[name] = 1
            break
    return cache_arg, extra


def _new_cache(model: PreTrainedModel) -> DynamicCache:
    """A fresh KV cache; the model updates it in place, so the loop never reads it back from outputs."""
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


class TorchEngine:
    """Batched sampling with an in-process HF model, at a known weight version.

    ``generate`` and ``load_weights`` serialise on one lock, so a generation never mixes two weight
    versions and the ``weight_version`` recorded in each :class:`Generation` is exact.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        pad_token_id: int,
        cfg: TorchEngineConfig | None = None,
        version: int = 0,
        seed: int | None = None,
    ) -> None:
        self.cfg = cfg or TorchEngineConfig()
        self.model = model.to(device=self.cfg.device, dtype=to_torch_dtype(self.cfg.dtype)).eval()
        self.device = torch.device(self.cfg.device)
        self.pad_token_id = int(pad_token_id)
        self._version = int(version)
        self._lock = threading.Lock()
        self._cache_arg, self._forward_extra = _forward_kwargs(self.model)
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    @property
    def version(self) -> int:
        """Policy version of the weights generation currently uses."""
        return self._version

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """One completion per prompt. Output ids include the stop token that ended a row, if any."""
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token (encode_prompt adds BOS)")
        if params.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {params.max_new_tokens}")
        with self._lock, torch.inference_mode():
            version = self._version
            tokens, logprobs, lengths, stopped = self._sample_loop(prompts, params)
        return [
            Generation(
                prompt_ids=list(prompt),
                output_ids=tokens[i][: lengths[i]],
                logprobs=logprobs[i][: lengths[i]],
                finish_reason="stop" if stopped[i] else "length",
                weight_version=version,
            )
            for i, prompt in enumerate(prompts)
        ]

    def _sample_loop(
        self, prompts: list[list[int]], params: SamplingParams
    ) -> tuple[list[list[int]], list[list[float]], list[int], list[bool]]:
        dev = self.device
        batch, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)  # (B, T)
        mask = torch.zeros((batch, width), dtype=torch.long)  # (B, T)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        input_ids, mask = input_ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, T): each row starts at 0 after its padding
        stop_ids = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=dev)  # (S,)

        out_tokens = torch.full((batch, params.max_new_tokens), self.pad_token_id, dtype=torch.long, device=dev)
        out_logp = torch.zeros((batch, params.max_new_tokens), dtype=torch.float32, device=dev)  # (B, N)
        lengths = torch.zeros(batch, dtype=torch.long, device=dev)  # (B,)
        finished = torch.zeros(batch, dtype=torch.bool, device=dev)  # (B,)

        fwd = {self._cache_arg: _new_cache(self.model), **self._forward_extra}
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, **fwd)
        next_pos = positions[:, -1:] + 1  # (B, 1)
        for step in range(params.max_new_tokens):
            tokens, logp = sample_next(out.logits[:, -1, :], params, self._generator)  # (B,), (B,)
            tokens = tokens.masked_fill(finished, self.pad_token_id)
            out_tokens[:, step] = tokens
            out_logp[:, step] = logp
            lengths += (~finished).long()
            finished |= torch.isin(tokens, stop_ids)
            if step + 1 == params.max_new_tokens or bool(finished.all()):
                break
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=dev)], dim=1)  # (B, T+step+1)
            out = self.model(input_ids=tokens.unsqueeze(-1), attention_mask=mask, position_ids=next_pos, **fwd)
            next_pos = next_pos + 1
        return out_tokens.tolist(), out_logp.tolist(), lengths.tolist(), finished.tolist()

    # ------------------------------------------------------------------ weights

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy a full HF state dict into the model in place (dtype/device converted), adopt ``version``.

        Everything is validated before anything is copied, so a bad payload leaves the old weights
        intact. Tied parameters (e.g. ``lm_head.weight`` sharing the embedding) may be given once.
        """
        targets = self.model.state_dict()
        for key in state:
            if key not in targets:
                raise ValueError(f"load_weights: unexpected key {key!r} (not in the model's state dict)")
        provided_storages = {targets[k].untyped_storage().data_ptr() for k in state}
        for key, target in targets.items():
            if key not in state and target.untyped_storage().data_ptr() not in provided_storages:
                raise ValueError(f"load_weights: missing key {key!r}")
        for key, tensor in state.items():
            if tuple(tensor.shape) != tuple(targets[key].shape):
                raise ValueError(
                    f"load_weights: shape mismatch for {key!r}: got {tuple(tensor.shape)}, "
                    f"model has {tuple(targets[key].shape)}"
                )
        with self._lock, torch.no_grad():
            for key, tensor in state.items():
                targets[key].copy_(tensor)
            self._version = int(version)
