"""The policy's weights at the last few versions, kept on every trainer rank for the log-prob audit.

A trajectory reaches the trainer up to ``staleness.max_staleness`` versions after the weights that sampled it;
by then the trainer holds newer ones. To re-compute its behaviour log-probs (:mod:`miles.training.audit`),
each rank copies its own shards of the trainable weights to CPU at every version it publishes, and puts a
version back for the length of a scoring pass. Memory per rank: ``keep`` copies of its shards (of its part of
the model, or only the adapters with LoRA); nothing is gathered.

Workers hold the weights in rollout precision (``sync.dtype``). Where that is a plain cast of the trained
tensors (``bfloat16`` or ``float32``, full fine-tuning), the copies are taken in it, so a version scores with
exactly the weights its workers held; otherwise (FP8/FP4 codes, LoRA merged on the worker) they stay in the
trainer's precision and the honest gap includes the rollout quantization's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from miles.backends.base import TrainBackend


class VersionSnapshots:
    """CPU copies of this rank's policy tensors at the ``keep`` newest versions taken."""

    def __init__(self, backend: TrainBackend, keep: int, dtype: torch.dtype | None = None) -> None:
        self.backend = backend
        self.keep = keep
        self.dtype = dtype  # rollout precision to take the copies in; None: the trained tensors' own
        self._copies: OrderedDict[int, list[torch.Tensor]] = OrderedDict()
        self.current: int | None = None  # the version the live weights are

    def __contains__(self, version: object) -> bool:
        return version in self._copies

    @torch.no_grad()
    def take(self, version: int) -> None:
        """Copy the live weights as ``version`` (they were just published under it)."""
        self._copies[version] = [
            t.detach().to("cpu", dtype=self.dtype or t.dtype, copy=True) for t in self.backend.policy_tensors()
        ]
        self._copies.move_to_end(version)
        while len(self._copies) > self.keep:
            self._copies.popitem(last=False)
        self.current = version

    @contextmanager
    def weights_of(self, version: int) -> Iterator[None]:
        """The live weights are ``version``'s (as its workers held them) inside the block, and exactly what they
        were again after it (nothing the optimizer holds changes)."""
        if version not in self._copies:
            raise KeyError(f"no snapshot of version {version} (held: {list(self._copies)})")
        if version == self.current and self.dtype is None:
            yield  # the live weights are that copy
            return
        with torch.no_grad():
            live = [t.detach().to("cpu", copy=True) for t in self.backend.policy_tensors()]
        self._load(self._copies[version])
        try:
            yield
        finally:
            self._load(live)

    @torch.no_grad()
    def _load(self, tensors: list[torch.Tensor]) -> None:
        for live, saved in zip(self.backend.policy_tensors(), tensors, strict=True):
            live.copy_(saved)
