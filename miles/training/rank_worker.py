"""What every trainer rank runs, collectively: RL steps, weight export, checkpoints.

Only rank 0 talks to the bus. It drives the other ranks by broadcasting method calls on this object
(:mod:`miles.actors.trainer_ranks`), so every rank calls the same methods in the same order: the backend's
collectives (FSDP's all-gathers, Megatron's schedules) line up by construction.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch

from miles.algo.config import generation_budget
from miles.backends.base import TrainBackend, TrainSample
from miles.config import RunConfig
from miles.models.families.registry import family_of
from miles.sync.owned_delta import OwnedBase, OwnedPlan, OwnedTensor, owned_export
from miles.sync.stream_export import drain
from miles.training.checkpoint import CheckpointManager
from miles.training.snapshots import VersionSnapshots
from miles.training.step import RLStep
from miles.training.teacher import build_trainer_teacher

log = structlog.get_logger(__name__)


class RankWorker:
    """One rank's backend, RL step and checkpoint manager."""

    def __init__(self, backend: TrainBackend, cfg: RunConfig, run_dir: Path, *, pad_id: int) -> None:
        trainer = cfg.trainer
        self.backend = backend
        self.cfg = cfg
        self.rl = RLStep(
            backend,
            trainer,
            pad_id=pad_id,
            device=getattr(trainer.backend, "device", "cpu"),
            teacher=build_trainer_teacher(cfg),
            generation_budget=generation_budget(cfg),
        )
        # The weights of the versions a trajectory may still be trained at, for the log-prob audit.
        keep = cfg.staleness.max_staleness + 1
        cast = getattr(torch, cfg.sync.dtype) if cfg.rollout_weights_are_a_cast else None  # as workers hold them
        self.snapshots = VersionSnapshots(backend, keep, cast) if trainer.audit.logprob_rate > 0 else None
        # Delta sync: the previous published bits of the tensors this rank owns (miles.sync.owned_delta).
        self.delta_base = OwnedBase()
        self._owned_plan: OwnedPlan | None = None
        self.checkpoints = CheckpointManager(
            run_dir / "checkpoints", trainer.checkpoint_every, trainer.keep_checkpoints, trainer.async_checkpoint
        )

    @property
    def rank(self) -> int:
        return self.backend.rank

    @property
    def world_size(self) -> int:
        return self.backend.world_size

    def train(self, plan: Sequence[Sequence[Sequence[TrainSample]]]) -> dict[str, float]:
        """One rollout batch: ``plan[dp_rank][minibatch]`` (:func:`miles.training.step.plan_batch`)."""
        return self.rl.run(plan[self.backend.dp_rank])

    def snapshot_version(self, version: int) -> None:
        """Keep the live weights as ``version`` for the log-prob audit (they were just published)."""
        assert self.snapshots is not None, "trainer.audit.logprob_rate is 0"
        self.snapshots.take(version)

    def logprob_gaps(self, plan: Sequence[Sequence[tuple[int, TrainSample]]], total: int) -> list[float]:
        """The log-prob audit's per-sample differences (:meth:`RLStep.logprob_gaps`), each sample scored under
        the weights of its ``weight_version``; ``plan[dp_rank]``, every rank going through the same versions."""
        assert self.snapshots is not None, "trainer.audit.logprob_rate is 0"
        versions = sorted({sample.weight_version for shard in plan for _, sample in shard})
        mine = plan[self.backend.dp_rank]
        out = [0.0] * (2 * total)
        for version in versions:
            with self.snapshots.weights_of(version):
                sums = self.rl.logprob_gaps([(i, s) for i, s in mine if s.weight_version == version], total)
            out = [a + b for a, b in zip(out, sums, strict=True)]
        return out

    def drain_export(self, adapter_only: bool) -> int:
        """A rank's part of a streamed export that rank 0 consumes: every gather, nothing kept."""
        return drain(self.backend.export_params(adapter_only=adapter_only))

    def owned_export(self, anchor: bool) -> Iterator[OwnedTensor]:
        """This rank's part of a delta-mode export (:func:`miles.sync.owned_delta.owned_export`): it keeps the
        previous bits of the tensors it owns; rank 0 gets every tensor and its record."""
        if self._owned_plan is None:
            sync = self.cfg.sync
            specs = self.backend.export_specs()
            self._owned_plan = OwnedPlan.of(specs, sync.dtype, family_of(self.cfg.model), self.world_size)
        return owned_export(
            self.backend.export_params(), self._owned_plan, self.delta_base, rank=self.rank, anchor=anchor
        )

    def drain_owned_export(self, anchor: bool) -> int:
        return drain(self.owned_export(anchor))

    def save_checkpoint(self, step: int, extra: dict[str, Any]) -> None:
        self.checkpoints.save(step, self.backend, {**extra, "optimizer_steps": self.rl.steps_done})

    def poll_checkpoint(self) -> int | None:
        """Complete a finished asynchronous save (rank 0 writes its marker); never blocks."""
        return self.checkpoints.poll()

    def restore(self) -> dict[str, Any] | None:
        """Load the newest complete checkpoint; its ``extra`` (every rank), or None for a fresh start."""
        found = self.checkpoints.load_latest(self.backend)  # type: ignore[arg-type]
        if found is None:
            return None
        step, extra = found
        self.rl.steps_done = int(extra.get("optimizer_steps", step))
        return extra

    def close(self) -> None:
        self.checkpoints.close()
