"""Sync modes (``sync.mode``): how the trainer turns its weights into versions, registered by name.

A mode is a strategy over the sender's one stream (:class:`~miles.sync.sender.WeightSender`): it decides what
each version carries and calls the sender to write and announce it. The built-ins:

* ``full``: every version is the whole state, streamed into ``sync.transport`` as it is gathered.
* ``lora``: every version is ``trainer.lora``'s adapter only; the workers' engines apply it on the frozen base.
* ``delta``: every version is a sparse delta against the previous one, encoded by the trainer ranks that own
  each tensor (:mod:`miles.sync.owned_delta`), with a full anchor every ``sync.anchor_every`` versions or when
  a delta cannot be made.

Workers read every mode the same way: an announcement says which payload it is (``full``, ``lora`` or
``delta``, the wire formats :class:`~miles.sync.follower.WeightFollower` knows), so a mode of your own publishes
through those formats and needs nothing new on the workers. Register it from a module the recipe's
``plugins`` imports (docs/extending.md, "Your own sync mode")::

    @register_sync_mode("checkpoint_anchors")
    class CheckpointAnchors(DeltaMode): ...
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from miles.plugins import Registry

if TYPE_CHECKING:
    from miles.config import LoraConfig, RunConfig
    from miles.sync.publisher import Lineage, Published
    from miles.sync.sender import WeightSender


class SyncMode(ABC):
    """One trainer leader's publishing strategy (a fresh instance per sender: a mode may keep state)."""

    adapter_only: ClassVar[bool] = False  # versions carry only trainer.lora's adapter (workers serve it on the base)
    uses_delta_store: ClassVar[bool] = False  # the delta key space is opened (by the trainer and every worker)
    any_transport: ClassVar[bool] = True  # False: its payloads go over the bus whatever sync.transport says

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def check(self) -> None:
        """Refuse a config this mode cannot run, with a ``ValueError`` naming the key (run at config load)."""
        sync = self.cfg.sync
        if self.adapter_only and self.cfg.trainer.lora is None:
            raise ValueError(f"sync.mode {sync.mode!r} needs trainer.lora (the adapter to train and sync)")
        if not self.any_transport and sync.transport != "bus":
            raise ValueError(
                f"sync.transport {sync.transport!r} carries full payloads: sync.mode {sync.mode!r} needs 'bus'"
            )

    def worker_lora(self) -> LoraConfig | None:
        """The adapter the workers' engines serve on the frozen base, or None: they hold whole states."""
        return self.cfg.trainer.lora if self.adapter_only else None

    @abstractmethod
    async def publish(self, sender: WeightSender, version: int, lineage: Lineage) -> Published:
        """Write ``version`` of the trainer's weights and announce it (through ``sender``)."""


SYNC_MODES: Registry[SyncMode] = Registry("sync mode", by_path=False)  # factory(cfg: RunConfig) -> SyncMode
register_sync_mode = SYNC_MODES.register


def sync_mode(cfg: RunConfig) -> SyncMode:
    """The mode ``cfg.sync.mode`` names (a :class:`~miles.plugins.PluginError` names an unknown one)."""
    return SYNC_MODES.factory(cfg.sync.mode)(cfg)


@register_sync_mode("full")
class FullMode(SyncMode):
    """The whole state every version, streamed one tensor at a time into ``sync.transport``."""

    async def publish(self, sender: WeightSender, version: int, lineage: Lineage) -> Published:
        return await sender.stream(version, lineage, adapter_only=False, mode="full")


@register_sync_mode("lora")
class LoraMode(SyncMode):
    """Only the adapter, streamed like full weights (bf16 where ``sync.dtype`` quantizes)."""

    adapter_only = True
    any_transport = False

    async def publish(self, sender: WeightSender, version: int, lineage: Lineage) -> Published:
        return await sender.stream(version, lineage, adapter_only=True, mode="lora")


@dataclass(slots=True)
class DeltaSchedule:
    """When the next version must be a full anchor rather than a delta (the trainer leader's view)."""

    anchor_every: int
    previous: int | None = None  # newest version published by this process
    anchor: int | None = None  # newest anchor published by this process

    def anchor_reason(self, version: int) -> str | None:
        """Why ``version`` must be a full anchor (None: a delta will do)."""
        if self.previous is None:
            return "no_previous_state"  # first publish of this process (version 0, a restart, a failed export)
        if version == 0:
            return "version_0"
        if version <= self.previous:
            return "not_newer"
        if self.anchor is None or version - self.anchor >= self.anchor_every:
            return "anchor_every"
        return None

    def published(self, version: int, *, anchor: bool) -> None:
        self.previous = version
        if anchor:
            self.anchor = version

    def failed(self) -> None:
        """An export ended part-way: the owners' shares are mixed, so the next version is an anchor."""
        self.previous = None


@register_sync_mode("delta")
class DeltaMode(SyncMode):
    """Deltas against the previous version, full anchors on :class:`DeltaSchedule`'s rule or when an owner
    cannot encode one. Nothing is published by a new instance yet, so after a restart the first is an anchor."""

    uses_delta_store = True
    any_transport = False

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.schedule = DeltaSchedule(cfg.sync.anchor_every)

    def anchor_rule(self, version: int) -> str | None:
        """A reason of your own to publish ``version`` as a full anchor, or None (override it; the built-in
        rule, every ``sync.anchor_every`` versions and whenever there is no base, applies anyway)."""
        return None

    async def publish(self, sender: WeightSender, version: int, lineage: Lineage) -> Published:
        return await sender.store.retried(
            lambda: self._publish(sender, version, lineage), what=f"weights v{version} (delta mode)"
        )

    async def _publish(self, sender: WeightSender, version: int, lineage: Lineage) -> Published:
        reason = self.schedule.anchor_reason(version) or self.anchor_rule(version)
        try:
            if reason is None and self.schedule.previous is not None:
                published = await sender.owned_delta(version, lineage, base_version=self.schedule.previous)
                if published is not None:
                    self.schedule.published(version, anchor=False)
                    return published
                reason = "encoder_refused"
            published = await sender.owned_anchor(version, lineage)
        except BaseException:
            self.schedule.failed()  # the owners' shares may be part new, part old: the next one is an anchor
            raise
        self.schedule.published(version, anchor=True)
        sender.log.info("weights_anchor_published", version=version, reason=reason, bytes=published.announcement.size)
        return published
