"""Embedded generation engine: our own batched KV-cache sampling loop over an HF causal LM.

Why not ``model.generate``: we need the exact behaviour log-prob of every sampled token and
control at every token boundary (new weights switch in between two decode steps), both of which
are awkward through the generic generation API. The loop is short: one prefill of the left-padded
batch, then one single-token forward per step with the cache.

In-flight weight updates. :meth:`TorchEngine.stage_weights` puts a validated weight set in a
pending slot (newest version wins, never backwards); the sampling loop takes it at the next token
boundary and copies it into the model in place, so a long generation does not hold back a new
policy. Each :class:`Generation` records ``version_spans``: the output index from which each
version sampled.

KV-cache policy: **keep**. After a switch the cache computed by the old weights for the prompt and
the tokens generated so far is kept; only new tokens are computed with the new weights (as
PipelineRL and AReaL do). Recomputing the prefix would cost a full prefill of prompt + output per
switch for the whole batch, stall every row in it, and still would not make the earlier tokens
on-policy. Keeping it is exact where it matters: every token's behaviour log-prob is the
log-prob of the distribution it was actually drawn from (new weights over the old cache), which
is what the trainer's importance ratios correct against, and staleness is bounded by the oldest
span's version.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Mapping
from typing import Any

import structlog
import torch
from transformers import DynamicCache, PreTrainedModel

from miles.config import TorchEngineConfig
from miles.engines.base import Generation, SamplingParams, SparseValues
from miles.models.loading import to_torch_dtype

log = structlog.get_logger(__name__)


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
    """Batched sampling with an in-process HF model, at known weight versions.

    Two ways to change weights:

    * :meth:`load_weights` copies immediately; it waits for a running generation to finish (one
      lock serialises generation and copies), so it never lands mid-generation.
    * :meth:`stage_weights` (thread-safe, non-blocking; meant for the event-loop thread while
      :meth:`generate` runs in a worker thread) validates the weights and parks them in a pending
      slot. A running generation applies them at its next token boundary, keeping its KV cache
      (see the module docstring); otherwise the next :meth:`generate` or :meth:`apply_pending` does.

    ``Generation.weight_version`` is the version of the first generated token (the oldest one) and
    ``Generation.version_spans`` says which version sampled which tokens. Every applied switch is
    counted in ``switches`` and its copy time (the generation pause) kept in ``last_pause_s`` and
    ``pauses_s``.
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
        self._lock = threading.Lock()  # generation and weight copies
        self._slot_lock = threading.Lock()  # the pending slot below; never held across a copy
        # Staged updates, applied in order: one complete state, then partial ones (see stage_weights).
        self._pending: list[tuple[int, Mapping[str, torch.Tensor | SparseValues]]] = []
        self._applying: int | None = None  # version being copied in (taken from the slot, not yet adopted)
        self.switches = 0
        self.last_pause_s = 0.0
        self.pauses_s: list[float] = []  # one per applied switch (bounded: the most recent 1000)
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

    @property
    def pending_version(self) -> int | None:
        """Version staged (or being copied in) but not yet adopted; None if none."""
        with self._slot_lock:
            if self._pending:
                return self._pending[-1][0]
            return self._applying

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: list[list[int]], params: SamplingParams, switch: bool = True) -> list[Generation]:
        """One completion per prompt. Output ids include the stop token that ended a row, if any.

        Staged weights are applied first; weights staged while it runs switch in at a token boundary.
        """
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token (encode_prompt adds BOS)")
        if params.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {params.max_new_tokens}")
        with self._lock, torch.inference_mode():
            if switch:
                self._apply_pending_locked(at_token=None)
            spans = [(0, self._version)]
            tokens, logprobs, lengths, stopped = self._sample_loop(prompts, params, spans, switch)
        gens = []
        for i, prompt in enumerate(prompts):
            # A span that starts at or after a row's end never sampled any of that row's tokens.
            row_spans = [spans[0]] + [s for s in spans[1:] if s[0] < lengths[i]]
            gens.append(
                Generation(
                    prompt_ids=list(prompt),
                    output_ids=tokens[i][: lengths[i]],
                    logprobs=logprobs[i][: lengths[i]],
                    finish_reason="stop" if stopped[i] else "length",
                    weight_version=row_spans[0][1],
                    version_spans=row_spans,
                )
            )
        return gens

    def _sample_loop(
        self, prompts: list[list[int]], params: SamplingParams, spans: list[tuple[int, int]], switch: bool = True
    ) -> tuple[list[list[int]], list[list[float]], list[int], list[bool]]:
        """The batched loop; appends ``(first output index, version)`` to ``spans`` at every switch."""
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
            # Token boundary: newer staged weights switch in here; the KV cache is kept (module docstring).
            if switch and self._pending and self._apply_pending_locked(at_token=step + 1):
                spans.append((step + 1, self._version))
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=dev)], dim=1)  # (B, T+step+1)
            out = self.model(input_ids=tokens.unsqueeze(-1), attention_mask=mask, position_ids=next_pos, **fwd)
            next_pos = next_pos + 1
        return out_tokens.tolist(), out_logp.tolist(), lengths.tolist(), finished.tolist()

    # ------------------------------------------------------------------ weights

    def _validate(
        self, state: Mapping[str, torch.Tensor | SparseValues], what: str, *, complete: bool = True
    ) -> dict[str, torch.Tensor]:
        """Check ``state`` fits the model (and covers it if ``complete``); return the model's state dict."""
        targets = self.model.state_dict()
        for key in state:
            if key not in targets:
                raise ValueError(f"{what}: unexpected key {key!r} (not in the model's state dict)")
        if complete:
            provided_storages = {targets[k].untyped_storage().data_ptr() for k in state}
            for key, target in targets.items():
                if key not in state and target.untyped_storage().data_ptr() not in provided_storages:
                    raise ValueError(f"{what}: missing key {key!r}")
        for key, value in state.items():
            target = targets[key]
            if isinstance(value, SparseValues):
                index, values = value.index, value.values
                if index.dim() != 1 or values.dim() != 1 or index.numel() != values.numel():
                    raise ValueError(f"{what}: sparse update of {key!r} needs 1-D index and values of equal length")
                if index.dtype != torch.int64:
                    raise ValueError(f"{what}: sparse update of {key!r} has index dtype {index.dtype}, not int64")
                if index.numel() and not (0 <= int(index.min()) and int(index.max()) < target.numel()):
                    raise ValueError(f"{what}: sparse update of {key!r} indexes outside its {target.numel()} elements")
            elif tuple(value.shape) != tuple(target.shape):
                raise ValueError(
                    f"{what}: shape mismatch for {key!r}: got {tuple(value.shape)}, model has {tuple(target.shape)}"
                )
        return targets

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int, *, complete: bool = True) -> None:
        """Copy a full HF state dict into the model in place (dtype/device converted), adopt ``version``.

        Everything is validated before anything is copied, so a bad payload leaves the old weights
        intact. Tied parameters (e.g. ``lm_head.weight`` sharing the embedding) may be given once.
        ``complete=False`` loads only the given tensors (e.g. adapter-merged modules on a fixed base).
        Immediate and unconditional (any version, even an older one); waits for a running generation.
        A staged version not newer than ``version`` is dropped.
        """
        targets = self._validate(state, "load_weights", complete=complete)
        with self._lock, torch.no_grad():
            for key, tensor in state.items():
                targets[key].copy_(tensor)
            self._version = int(version)
            with self._slot_lock:
                if self._pending and self._pending[-1][0] <= self._version:
                    self._pending = []

    def stage_weights(
        self,
        state: Mapping[str, torch.Tensor | SparseValues],
        version: int,
        *,
        base_version: int | None = None,
        complete: bool = True,
    ) -> bool:
        """Park weights to be applied at the next token boundary (or next generate/apply_pending).

        Thread-safe and non-blocking (the copy happens later, in the thread that applies it). Keys and
        shapes are validated now (``ValueError``, nothing staged). Newest version wins: a version not
        newer than the one in use, being applied or already staged is ignored (returns False), so a
        worker several versions behind jumps to the newest and never goes back. The caller must not
        mutate ``state`` afterwards.

        ``complete=False`` stages a partial update: only the given tensors change, and a value may be
        :class:`SparseValues` (new values at flat positions). Partial updates queue behind what is
        already staged and are applied in order. With ``base_version`` the update is relative to that
        version (a delta): it is refused (False) unless the engine will be exactly there when it
        applies, so a delta is never applied on top of the wrong weights. Without it, the tensors it
        names are absolute (e.g. adapter-merged weights on a fixed base).
        """
        if not complete and base_version is None and any(isinstance(v, SparseValues) for v in state.values()):
            raise ValueError("stage_weights: sparse values are relative, so they need base_version")
        self._validate(state, "stage_weights", complete=complete)
        version = int(version)
        with self._slot_lock:
            newest = self._newest_locked()
            if version <= newest:
                return False
            if complete:
                self._pending = [(version, state)]
            elif base_version is not None and int(base_version) != newest:
                return False
            else:
                self._pending.append((version, state))
        return True

    def _newest_locked(self) -> int:
        """Version the engine will be at once everything staged is applied (caller holds ``_slot_lock``)."""
        return max(
            self._version,
            self._pending[-1][0] if self._pending else -1,
            self._applying if self._applying is not None else -1,
        )

    def apply_pending(self) -> bool:
        """Apply staged weights now if the engine is idle; True if it switched.

        Never blocks on a running generation (that one applies them at its next token boundary).
        """
        if not self._lock.acquire(blocking=False):
            return False
        try:
            with torch.no_grad():
                return self._apply_pending_locked(at_token=None)
        finally:
            self._lock.release()

    def _apply_pending_locked(self, at_token: int | None) -> bool:
        """Copy the staged updates in, in order (caller holds ``_lock``); True if the version changed."""
        with self._slot_lock:
            staged, self._pending = self._pending, []
            if not staged or staged[-1][0] <= self._version:
                return False
            version = staged[-1][0]
            self._applying = version
        try:
            start = time.perf_counter()
            targets = self.model.state_dict()
            for _, state in staged:
                for key, value in state.items():
                    target = targets[key]
                    if isinstance(value, SparseValues):
                        target.view(-1).index_copy_(0, value.index, value.values.to(target.dtype))
                    else:
                        target.copy_(value)
            pause = time.perf_counter() - start
            self._version = version
        finally:
            with self._slot_lock:
                self._applying = None
        self.switches += 1
        self.last_pause_s = pause
        self.pauses_s = [*self.pauses_s[-999:], pause]
        log.info(
            "weights_applied", version=version, pause_ms=round(pause * 1e3, 2), at_token=at_token, updates=len(staged)
        )
        return True
