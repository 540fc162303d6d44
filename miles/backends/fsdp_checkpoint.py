"""Sharded checkpoints of an FSDP2 model and its optimizer with torch.distributed.checkpoint (DCP).

Each rank writes its own shard (``__<rank>_0.distcp``) and the coordinator (rank 0) writes ``.metadata``
once every rank's write has succeeded, so no rank ever gathers the model. DCP records each shard's global
offsets, so a checkpoint loads onto another rank count (2 -> 1, 1 -> 2, ...): every rank reads the pieces
that overlap its own shards. A single process without a process group (an unsharded model) saves and
loads the same format.

What is saved, under top-level keys of one DCP state dict:

* ``model`` and ``optim``: :func:`~torch.distributed.checkpoint.state_dict.get_state_dict` (sharded,
  keyed by parameter FQN, so the optimizer state survives resharding). ``adapter_only`` (LoRA) drops
  frozen parameters: the adapters and their optimizer state only; the frozen base comes from the model
  the run started from. Tied weights included: ``ignore_frozen_params`` alone keeps a tied ``lm_head``
  (it is not among the de-duplicated named parameters), 113 MB of a 121 MB SmolLM2-135M checkpoint.
* ``reference``: an optional frozen reference model (KL against the initial policy).
* ``extra``: small plain values of the backend (e.g. its step counter), stored once.

Asynchronous saves (``asynchronous=True``) use ``dcp.async_save``: the state is first *staged*, i.e.
copied into fresh CPU memory (on CPU too, so training may change the live tensors right after the call;
the copy costs one extra shard of model + optimizer state until the write ends), then written by a
background thread. That thread runs DCP's collectives (plan, finish) on a dedicated gloo group created on
the first asynchronous save, never on the trainer's group, so they cannot interleave with the training
step's collectives. The returned :class:`SaveHandle` must be waited on (``result()``): that is where a
failed write surfaces.

Completion: when :func:`save_sharded` returns (synchronous) or the handle resolves (asynchronous) on rank
0, every shard and the metadata are written and fsynced (``FileSystemWriter(sync_files=True)``), because
the coordinator writes the metadata only after gathering every rank's write result. Marking a checkpoint
complete, keeping the newest k and crash semantics are :mod:`miles.training.checkpoint`'s job.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer

log = structlog.get_logger(__name__)

_async_group_of: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None  # (default group, its async gloo group)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _options(adapter_only: bool) -> StateDictOptions:
    # strict=False with adapter_only: the frozen base is absent from the state dict on purpose.
    return StateDictOptions(ignore_frozen_params=adapter_only, strict=not adapter_only)


def _state(
    model: nn.Module, optimizer: Optimizer, *, adapter_only: bool, reference: nn.Module | None
) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(adapter_only))
    if adapter_only:
        trainable = {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        model_sd = {name: value for name, value in model_sd.items() if name in trainable}
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    if reference is not None:
        state["reference"] = get_model_state_dict(reference)
    return state


def _async_group() -> dist.ProcessGroup | None:
    """A gloo group over all ranks for the background thread's collectives (created collectively, once)."""
    global _async_group_of
    if not _distributed():
        return None
    world = dist.group.WORLD
    if _async_group_of is None or _async_group_of[0] is not world:  # none yet, or the default group was re-made
        _async_group_of = (world, dist.new_group(backend="gloo"))
    return _async_group_of[1]


@dataclass(slots=True)
class SaveHandle:
    """An asynchronous save in flight. ``result()`` waits and re-raises a failed write (on every rank)."""

    path: Path
    future: Future
    started: float = field(default_factory=time.perf_counter)

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> None:
        self.future.result(timeout=timeout)


def save_sharded(
    model: nn.Module,
    optimizer: Optimizer,
    path: str | os.PathLike[str],
    *,
    adapter_only: bool = False,
    asynchronous: bool = False,
    reference: nn.Module | None = None,
    extra: Mapping[str, Any] | None = None,
) -> SaveHandle | None:
    """Write this rank's shard of model and optimizer (and ``reference``, ``extra``) under directory ``path``.

    Collective. Synchronous: returns once the checkpoint is written on every rank (``None``). Asynchronous:
    returns after staging with a :class:`SaveHandle`; the caller must not start another save, nor exit,
    before ``handle.result()`` returned. ``extra``: flat scalars (the backend's counters), stored once.
    """
    target = Path(path)
    extra = dict(extra or {})
    for key, value in extra.items():
        if not isinstance(value, (bool, int, float, str)) or "." in key:
            raise TypeError(f"extra[{key!r}]: only flat scalar values (bool, int, float, str) under dot-free keys")
    state = _state(model, optimizer, adapter_only=adapter_only, reference=reference)
    state["extra"] = extra
    writer = FileSystemWriter(target, sync_files=True)
    started = time.perf_counter()
    with warnings.catch_warnings():
        # DCP warns that a save without a process group is single-process: it is, on purpose.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if asynchronous:
            response = dcp.async_save(
                state, storage_writer=writer, process_group=_async_group(), no_dist=not _distributed()
            )
            future = getattr(response, "upload_completion", response)  # a Future, or an AsyncSaveResponse
            log.info("checkpoint.staged", path=str(target), seconds=round(time.perf_counter() - started, 3))
            return SaveHandle(target, future, started)
        dcp.save(state, storage_writer=writer, no_dist=not _distributed())
    log.info("checkpoint.saved", path=str(target), seconds=round(time.perf_counter() - started, 3))
    return None


def load_sharded(
    model: nn.Module,
    optimizer: Optimizer,
    path: str | os.PathLike[str],
    *,
    adapter_only: bool = False,
    reference: nn.Module | None = None,
) -> dict[str, Any]:
    """Restore model and optimizer (and ``reference``) from ``path`` in place; returns the saved ``extra``.

    Collective. Works on any rank count and sharding (or none): DCP reads, for every local shard, the
    overlapping pieces of the saved ones. The optimizer's state is initialised first if it is empty (DCP
    loads into existing tensors), which ``get_state_dict`` does with a zero-learning-rate step.
    ``adapter_only`` must match the save.
    """
    source = Path(path)
    reader = FileSystemReader(source)
    saved = set(reader.read_metadata().state_dict_metadata)
    if (reference is not None) != any(key.startswith("reference.") for key in saved):
        raise ValueError(f"{source}: reference model given={reference is not None}, but the checkpoint disagrees")
    state = _state(model, optimizer, adapter_only=adapter_only, reference=reference)
    extra_keys = sorted(key.removeprefix("extra.") for key in saved if key.startswith("extra."))
    state["extra"] = dict.fromkeys(extra_keys)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=not _distributed())
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_options(adapter_only),
    )
    if reference is not None:
        set_model_state_dict(reference, state["reference"])
    log.info("checkpoint.loaded", path=str(source), adapter_only=adapter_only)
    return dict(state["extra"])


def saved_keys(path: str | os.PathLike[str]) -> list[str]:
    """The flattened keys a checkpoint holds (``model.<fqn>``, ``optim.state.<fqn>.exp_avg``, ...)."""
    return sorted(FileSystemReader(Path(path)).read_metadata().state_dict_metadata)
