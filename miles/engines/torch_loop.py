"""The sampling loop of the torch engine, one token boundary at a time (continuous batching).

The loop holds a *running batch*: one KV cache whose rows are requests at different lengths. At every
token boundary the engine thread calls, in order:

1. :meth:`SamplingLoop.retire` - rows that finished (or whose caller cancelled) leave the batch;
2. :meth:`SamplingLoop.admit` - requests waiting in the inbox are picked to join (then the engine copies in
   staged weights, if any);
3. :meth:`SamplingLoop.prefill` - their prompts go through the model in one left-padded forward (one row
   per *distinct* prompt: a GRPO group's samples share one prefill, then the cache rows are repeated), and
   each newcomer samples its first token;
4. :meth:`SamplingLoop.merge` - the newcomers' cache joins the running one (see :mod:`kv_cache`);
5. :meth:`SamplingLoop.step` - one single-token forward for every row, then :meth:`SamplingLoop.sample`.

Nothing here knows about threads or asyncio: the engine (:mod:`miles.engines.torch_engine`) owns those
and calls these steps while holding its model lock.

Fallback (architectures whose cache cannot be merged, :func:`kv_cache.batching_plan`): a batch is a
cohort of requests with one identical prompt, admitted only when no batch runs, so no row is ever
padded; finished rows still leave it (``Cache.reorder_cache`` works for every layer type).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from miles.engines import kv_cache
from miles.engines.base import FinishReason, Generation, SamplingParams
from miles.engines.model_forward import Forward
from miles.engines.sampling import sample_tokens

UNIFORM_CHUNK = 64  # uniforms drawn at a time from a request's generator


@dataclass(slots=True, eq=False)
class Request:
    """One ``generate`` call as the loop sees it. ``deliver`` hands its outcome back to the caller's loop."""

    prompt: list[int]
    params: SamplingParams
    seed: int
    deliver: Callable[[Generation | BaseException], None]
    # Set by the event-loop thread when the awaiting task is cancelled; a bool store is atomic under the GIL,
    # and the loop only ever reads it at a token boundary.
    cancelled: bool = False


@dataclass(slots=True, eq=False)
class Row:
    """A request in the running batch: its budget, its random stream and what it has sampled so far."""

    request: Request
    budget: int  # most output tokens: max_new_tokens, clamped to what fits in the context
    clamped: bool  # the context, not max_new_tokens, set the budget
    stop: frozenset[int]
    generator: torch.Generator | None  # the request's own random stream; None when greedy
    uniforms: list[float] = field(default_factory=list)  # drawn from it, one per output token so far (and ahead)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    finish: FinishReason | None = None

    def uniform(self) -> float:
        """The uniform number (0, 1] that draws the next token (drawn in chunks: budgets can be huge)."""
        if self.generator is None:
            return 1.0
        index = len(self.output)
        while index >= len(self.uniforms):
            chunk = torch.rand(UNIFORM_CHUNK, generator=self.generator, dtype=torch.float64)
            self.uniforms.extend((1.0 - chunk).tolist())  # [0, 1) -> (0, 1]
        return self.uniforms[index]

    def add(self, token: int, logprob: float, version: int) -> None:
        """Record one sampled token under ``version``; set ``finish`` if it ends the request."""
        if not self.spans or self.spans[-1][1] != version:
            self.spans.append((len(self.output), version))
        self.output.append(token)
        self.logprobs.append(logprob)
        if token in self.stop:
            self.finish = "stop"
        elif len(self.output) >= self.budget:
            self.finish = "context" if self.clamped else "length"

    def generation(self, version: int) -> Generation:
        """The result; ``version`` is used only when no token was sampled (the prompt filled the context)."""
        assert self.finish is not None
        return Generation(
            prompt_ids=self.request.prompt,
            output_ids=self.output,
            logprobs=self.logprobs,
            finish_reason=self.finish,
            weight_version=self.spans[0][1] if self.spans else version,
            version_spans=list(self.spans),
        )


@dataclass(slots=True)
class Batch:
    """Rows and their tensors, aligned: row ``i`` of every tensor belongs to ``rows[i]``."""

    rows: list[Row]
    cache: DynamicCache
    mask: torch.Tensor  # (B, T) long: 1 where cache column t holds a token of row b (right-aligned)
    last: torch.Tensor  # (B,) long: each row's newest token, sampled but not yet in the cache
    pos: torch.Tensor  # (B,) long: the position id ``last`` will be fed at
    temperature: torch.Tensor  # (B,) float, 0 = greedy
    top_p: torch.Tensor  # (B,) float


class SamplingLoop:
    """Continuous batching over an HF causal LM (the steps the module docstring lists)."""

    def __init__(
        self,
        model: Any,
        pad_token_id: int,
        *,
        max_context: int,
        max_batch: int,
        max_prefill_tokens: int,
        continuous: bool,
        device: torch.device,
        forward: Forward,
    ) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.max_context = max_context
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.continuous = continuous
        self._forward = forward  # logits (B, V) at the last input position; appends to the cache in place
        self.device = device
        self.batch: Batch | None = None
        self._done: list[Row] = []  # finished without entering the batch (the prompt fills the context)

    @property
    def rows(self) -> list[Row]:
        return [] if self.batch is None else self.batch.rows

    # ------------------------------------------------------------------ admit

    def admit(self, inbox: deque[Request]) -> list[Request]:
        """Pop the requests that join at this boundary: FIFO, up to ``max_batch`` rows in all, and a padded
        prefill of at most ``max_prefill_tokens`` (distinct prompts x longest prompt; one request always fits)."""
        if not self.continuous and self.batch is not None:
            return []  # fallback: a cohort runs alone until it is done
        chosen: list[Request] = []
        prompts: set[tuple[int, ...]] = set()
        widest = 0
        while inbox and len(self.rows) + len(chosen) < self.max_batch:
            request = inbox[0]
            if request.cancelled:
                inbox.popleft()
                continue
            key = tuple(request.prompt)
            if not self.continuous and chosen and key not in prompts:
                break  # fallback: one prompt per cohort, so nothing is ever padded
            distinct = len(prompts) + (key not in prompts)
            width = max(widest, len(request.prompt))
            if chosen and distinct * width > self.max_prefill_tokens:
                break
            chosen.append(inbox.popleft())
            prompts.add(key)
            widest = width
        return chosen

    def _row(self, request: Request) -> Row:
        params = request.params
        room = self.max_context - len(request.prompt)
        budget = max(0, min(params.max_new_tokens, room))
        generator = torch.Generator().manual_seed(request.seed) if params.temperature > 0 else None
        row = Row(request, budget, budget < params.max_new_tokens, frozenset(params.stop_token_ids), generator)
        if budget == 0:
            row.finish = "context"
        return row

    # ------------------------------------------------------------------ prefill

    def prefill(self, requests: list[Request], version: int) -> Batch | None:
        """One forward over the distinct prompts of ``requests``; every newcomer samples its first token.

        Returns the newcomers as a batch of their own (None if all of them finished at once: a prompt that
        fills the context never reaches the model)."""
        rows = [self._row(r) for r in requests]
        self._done.extend(r for r in rows if r.finish is not None)
        rows = [r for r in rows if r.finish is None]
        if not rows:
            return None
        distinct: dict[tuple[int, ...], int] = {}
        for row in rows:
            distinct.setdefault(tuple(row.request.prompt), len(distinct))
        width = max(len(p) for p in distinct)
        ids = torch.full((len(distinct), width), self.pad_token_id, dtype=torch.long)  # (U, P)
        mask = torch.zeros((len(distinct), width), dtype=torch.long)  # (U, P)
        for i, prompt in enumerate(distinct):
            ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[i, width - len(prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (U, P): each row counts from 0 after its padding
        cache = kv_cache.new_cache(self.model, self.continuous)
        logits = self._forward(ids, mask, positions, cache)  # (U, V)

        expand = torch.tensor([distinct[tuple(r.request.prompt)] for r in rows], device=self.device)  # (B,)
        mask = mask.index_select(0, expand)  # (B, P)
        if self.continuous:
            kv_cache.select_rows(cache, expand)  # one prefill, repeated for a group's samples
            kv_cache.zero_padding(cache, mask)
        else:
            cache.reorder_cache(expand)  # the fallback's cohort has one prompt: no padding to zero
        batch = Batch(
            rows=rows,
            cache=cache,
            mask=mask,
            last=torch.zeros(len(rows), dtype=torch.long, device=self.device),  # set by sample below
            pos=mask.sum(-1),  # (B,): the first output token sits right after the prompt
            temperature=torch.tensor([r.request.params.temperature for r in rows], device=self.device),
            top_p=torch.tensor([r.request.params.top_p for r in rows], device=self.device),
        )
        self.sample(batch, logits.index_select(0, expand), version)
        return batch

    # ------------------------------------------------------------------ merge

    def merge(self, new: Batch) -> None:
        """Newcomers join the running batch: caches and masks left-padded to one width, rows appended."""
        old = self.batch
        if old is None:
            self.batch = new
            return
        width, new_width = old.mask.shape[1], new.mask.shape[1]
        kv_cache.concat_rows(old.cache, width, new.cache, new_width)
        total = max(width, new_width)
        old.mask = torch.cat(
            [
                torch.nn.functional.pad(old.mask, (total - width, 0)),  # (B1, total)
                torch.nn.functional.pad(new.mask, (total - new_width, 0)),  # (B2, total)
            ]
        )
        old.rows = old.rows + new.rows
        old.last = torch.cat([old.last, new.last])
        old.pos = torch.cat([old.pos, new.pos])
        old.temperature = torch.cat([old.temperature, new.temperature])
        old.top_p = torch.cat([old.top_p, new.top_p])

    # ------------------------------------------------------------------ step, sample

    def step(self, version: int) -> None:
        """Feed every row's newest token (one forward for the whole batch) and sample the next one."""
        batch = self.batch
        assert batch is not None
        ones = torch.ones((len(batch.rows), 1), dtype=batch.mask.dtype, device=self.device)
        batch.mask = torch.cat([batch.mask, ones], dim=1)  # (B, T + 1): the new token's column
        logits = self._forward(batch.last.unsqueeze(-1), batch.mask, batch.pos.unsqueeze(-1), batch.cache)  # (B, V)
        batch.pos = batch.pos + 1
        self.sample(batch, logits, version)

    def sample(self, batch: Batch, logits: torch.Tensor, version: int) -> None:
        """Draw each row's next token from ``logits`` (B, V) with its own parameters; record it under ``version``."""
        uniforms = torch.tensor([r.uniform() for r in batch.rows], dtype=torch.float64, device=self.device)  # (B,)
        tokens, logprobs = sample_tokens(logits, batch.temperature, batch.top_p, uniforms)  # (B,), (B,)
        batch.last = tokens
        for row, token, logprob in zip(batch.rows, tokens.tolist(), logprobs.tolist(), strict=True):
            row.add(token, logprob, version)

    # ------------------------------------------------------------------ retire

    def retire(self) -> list[Row]:
        """Remove finished and cancelled rows from the batch; return the finished ones (cancelled rows have
        no one to deliver to). Columns left as padding in every remaining row are trimmed."""
        done, self._done = self._done, []
        batch = self.batch
        if batch is None:
            return done
        keep = [i for i, r in enumerate(batch.rows) if r.finish is None and not r.request.cancelled]
        done.extend(r for r in batch.rows if r.finish is not None and not r.request.cancelled)
        if len(keep) < len(batch.rows):
            self._select(keep)
        return done

    def _select(self, keep: list[int]) -> None:
        batch = self.batch
        assert batch is not None
        if not keep:
            self.batch = None  # frees the cache
            return
        index = torch.tensor(keep, device=self.device)  # (R,)
        if self.continuous:
            kv_cache.select_rows(batch.cache, index)
        else:
            batch.cache.reorder_cache(index)
        batch.rows = [batch.rows[i] for i in keep]
        batch.mask = batch.mask.index_select(0, index)
        batch.last = batch.last.index_select(0, index)
        batch.pos = batch.pos.index_select(0, index)
        batch.temperature = batch.temperature.index_select(0, index)
        batch.top_p = batch.top_p.index_select(0, index)
        if self.continuous:
            # Rows are right-aligned, so all-padding columns can only be leading ones: the longest row starts there.
            leading = int(batch.mask.any(dim=0).int().argmax())
            kv_cache.trim_left(batch.cache, leading)
            batch.mask = batch.mask[:, leading:]

    def abandon(self) -> list[Row]:
        """Every row still held (in the batch or finished but undelivered), dropping the batch: for failure/close."""
        rows = self._done + self.rows
        self._done, self.batch = [], None
        return rows
