"""One RL step on one trainer rank, the same for every backend.

Given this rank's share of a rollout batch (advantages already computed), :class:`RLStep`:

1. packs each of its mini-batches (:func:`plan_batch` splits a rollout batch into
   ``trainer.algo.minibatches`` of them, then over the data-parallel ranks) into micro-batches, padded so
   that every data-parallel rank runs the same number (collectives must match);
2. scores the proximal policy (the weights at the start of the batch) and, for a KL term, the reference, and
   for on-policy distillation with a teacher in the trainer, the teacher, all without gradients;
3. per mini-batch: gets the global token and sequence counts, lets the backend accumulate gradients of the
   objective's loss function over its micro-batches, and takes one optimizer step;
4. reduces the metrics over ranks.

Several mini-batches make several optimizer steps against one proximal policy, so the PPO ratio moves
away from 1 and its clip acts; with one mini-batch the ratio is exactly 1 at the forward. The proximal
policy is then the very weights the training forward runs on, so step 2's no-grad pass is skipped: the
loss takes the proximal log-probs (and the entropy metric) from the training forward, detached. Same
numbers, one forward fewer per step (a fifth of the quickstart trainer's CPU, benchmarks/RESULTS.md).

A mini-batch without signal (every advantage 0 on every rank, and no KL, entropy or distillation term) is
scored but not stepped: its gradient is exactly 0, and an AdamW step on it would only replay the momentum
of earlier batches (for several steps, each about ``lr`` on every weight) and decay the weights. With
sparse rewards (a few successes per batch) that drift is what undoes learning. The learning-rate clock
still advances.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog
import torch

from miles.algo.objective import Objective
from miles.backends.base import MicroBatch, TrainBackend, TrainSample
from miles.backends.lr_schedule import lr_at
from miles.training.packing import pack_micro_batches, pad_to, shard_for_data_parallel
from miles.training.teacher import TeacherScorer

log = structlog.get_logger(__name__)


def has_signal(sample: TrainSample) -> bool:
    """Whether any of the sample's advantages is non-zero."""
    advantage = sample.advantage
    return any(a != 0.0 for a in advantage) if isinstance(advantage, list) else advantage != 0.0


def split_minibatches(samples: Sequence[TrainSample], count: int) -> list[list[TrainSample]]:
    """Round-robin split, so every mini-batch mixes the batch's groups."""
    return [list(samples[i::count]) for i in range(count)]


def plan_batch(samples: Sequence[TrainSample], minibatches: int, dp_size: int) -> list[list[list[TrainSample]]]:
    """``plan[dp_rank][minibatch]``: the global batch split into mini-batches first, then each mini-batch over
    the data-parallel ranks, so the optimisation does not depend on the number of ranks."""
    minis = [shard_for_data_parallel(m, dp_size) for m in split_minibatches(samples, minibatches)]
    return [[mini[rank] for mini in minis] for rank in range(dp_size)]


class RLStep:
    """Runs steps of the objective on a backend. ``steps_done`` counts optimizer steps (checkpointed: the
    learning-rate schedule's clock)."""

    def __init__(
        self,
        backend: TrainBackend,
        trainer_cfg: Any,
        *,
        pad_id: int,
        device: str = "cpu",
        teacher: TeacherScorer | None = None,
        generation_budget: int | None = None,
    ) -> None:
        self.backend = backend
        self.cfg = trainer_cfg
        self.objective = Objective(trainer_cfg.algo, generation_budget=generation_budget)
        distill = trainer_cfg.algo.distill
        if distill is not None and distill.teacher.type == "in_trainer" and teacher is None:
            raise ValueError("trainer.algo.distill.teacher.type 'in_trainer' needs the teacher loaded in the trainer")
        self.teacher = teacher
        self.pad_id = pad_id
        self.device = device
        self.steps_done = 0
        # One mini-batch: the proximal log-probs come from the training forward (module docstring). A switch
        # so that tests can compare with the separate proximal pass.
        self.fuse_proximal = True
        backend_cfg = trainer_cfg.backend
        self.token_budget: int | None = getattr(backend_cfg, "micro_batch_tokens", None)
        self.pack: bool = getattr(backend_cfg, "pack_sequences", True)
        # A teacher in the trainer scores the same micro-batches with its own model, which takes no shared mask.
        self.share_prompts = getattr(backend, "shares_prompts", False) and teacher is None

    def _micro_batches(self, samples: list[TrainSample]) -> list[MicroBatch]:
        batches = pack_micro_batches(
            samples,
            pad_id=self.pad_id,
            device=self.device,
            token_budget=self.token_budget,
            pack=self.pack,
            share_prompts=self.share_prompts,
        )
        (count,) = self.backend.all_reduce([float(len(batches))], op="max")
        return pad_to(batches, max(1, int(count)), self.pad_id, self.device)

    def logprob_gaps(self, indexed: Sequence[tuple[int, TrainSample]], total: int) -> list[float]:
        """The log-prob audit's forward (:mod:`miles.training.audit`), no gradients: for each of ``total``
        samples (this rank scores ``indexed``, ``(index, sample)``), the summed ``|log pi - log mu|`` over its
        loss-masked tokens under the current weights, then the number of those tokens: ``2 * total`` values,
        reduced over the data-parallel ranks."""
        samples = [sample for _, sample in indexed]
        batches = self._micro_batches(samples)
        out = [0.0] * (2 * total)
        for mb, scored in zip(batches, self.backend.score(batches), strict=True):
            diff = (scored.logp - mb.tensors["behaviour_logp"]).abs() * mb.loss_mask
            for span in mb.spans:
                index = indexed[span.sample][0]
                cut = slice(span.start, span.start + span.length)
                out[2 * index] += float(diff[span.row, cut].sum())
                out[2 * index + 1] += float(mb.loss_mask[span.row, cut].sum())
        return self.backend.all_reduce(out)

    def run(self, minibatches: Sequence[Sequence[TrainSample]]) -> dict[str, float]:
        """Train on this rank's part of each mini-batch (:func:`plan_batch`); one optimizer step per mini-batch.
        Every rank must pass the same number of mini-batches; every rank gets the same (global) metrics."""
        minis = [self._micro_batches(list(m)) for m in minibatches]
        signal = [float(sum(has_signal(s) for s in m)) for m in minibatches]
        if self.objective.gradient_needs_advantage:
            signal = self.backend.all_reduce(signal)
        else:
            signal = [1.0] * len(minis)  # another term of the loss has a gradient everywhere
        flat = [mb for mini in minis for mb in mini]
        fused = self.fuse_proximal and len(minis) == 1
        if not fused:
            for mb, out in zip(flat, self.backend.score(flat, entropy=True), strict=True):
                mb.tensors["prox_logp"] = out.logp
                assert out.entropy is not None
                mb.tensors["prox_entropy"] = out.entropy
        if self.objective.needs_reference:
            for mb, out in zip(flat, self.backend.score(flat, reference=True), strict=True):
                mb.tensors["ref_logp"] = out.logp
        if self.teacher is not None:
            for mb in flat:
                mb.tensors["teacher_logp"] = self.teacher.score(mb)
        elif self.objective.needs_teacher:  # a bus teacher: the leader put its log-probs on every sample
            for mb in flat:
                if mb.spans and "teacher_logp" not in mb.tensors:
                    raise ValueError("on-policy distillation: samples arrived without teacher log-probs")
                mb.tensors.setdefault("teacher_logp", torch.zeros_like(mb.loss_mask))  # padding micro-batches

        totals: dict[str, float] = {}
        grad_norms: list[float] = []
        lr = 0.0
        skipped_no_signal = 0
        for mini, mini_signal in zip(minis, signal, strict=True):
            lr = lr_at(self.cfg, self.steps_done)
            self.steps_done += 1
            local = [sum(mb.num_tokens for mb in mini), sum(mb.num_sequences for mb in mini)]
            num_tokens, num_sequences = self.backend.all_reduce([float(x) for x in local])
            loss_fn = self.objective.loss_fn(num_tokens, num_sequences)
            # Fused: the forward also gives the entropy metric the proximal pass would have.
            sums = self.backend.forward_backward(mini, loss_fn, entropy=fused or self.objective.entropy_in_loss)
            for key, value in sums.items():
                totals[key] = totals.get(key, 0.0) + value
            if mini_signal == 0:  # the metrics above still count; the zero gradient is dropped
                self.backend.optimizer_step(lr, skip=True)
                skipped_no_signal += 1
            else:
                grad_norms.append(self.backend.optimizer_step(lr))

        keys = sorted(totals)
        reduced = dict(zip(keys, self.backend.all_reduce([totals[k] for k in keys]), strict=True))
        metrics = self.objective.finalize(reduced, len(minis))
        finite = [g for g in grad_norms if torch.isfinite(torch.tensor(g))]
        metrics |= {
            "grad_norm": grad_norms[-1] if grad_norms else 0.0,
            "grad_norm_max": max(finite) if finite else (float("nan") if grad_norms else 0.0),
            "skipped_steps": float(len(grad_norms) - len(finite)),
            "lr": lr,
            "optimizer_steps": float(len(finite)),
            "skipped_no_signal": float(skipped_no_signal),
        }
        if metrics.get("distill_kl_zero"):
            log.warning(
                "distill_kl_zero",
                reason="the teacher's log-probs equal the student's on every token: nothing is distilled",
            )
        return metrics
