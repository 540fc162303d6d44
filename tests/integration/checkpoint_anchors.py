"""A sync mode of a user's own, named by a recipe through ``plugins``: deltas, with a full anchor at every
version the trainer checkpoints too (a worker that restarts with the trainer then fetches one anchor)."""

from __future__ import annotations

from miles.sync.modes import DeltaMode, register_sync_mode


@register_sync_mode("checkpoint_anchors")
class CheckpointAnchors(DeltaMode):
    def anchor_rule(self, version: int) -> str | None:
        return "checkpoint" if version % self.cfg.trainer.checkpoint_every == 0 else None
