"""Run megatron-core models on CPU, for contract tests and the GPU check's dry run only.

megatron-core assumes CUDA in a few places that do not matter for a float32, dropout-free forward: it
moves RoPE frequencies and router weights to ``torch.cuda.current_device()``, forks the CUDA RNG around
attention dropout, and distributed checkpointing calls ``torch.cuda.synchronize()``. :func:`cpu_megatron`
points the first at the CPU, makes the last a no-op and installs megatron's own inference RNG tracker
(whose ``fork`` does nothing), inside a context that undoes all three. Never used by
the backend itself: :func:`miles.backends.megatron.megatron_unavailable_reason` refuses CPU runs.

Still CUDA-only, and so never run here: the forward-backward schedules (they allocate a CUDA counter),
``DistributedDataParallel``, the distributed optimizer, and the all-to-all MoE dispatcher.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def cpu_megatron() -> Iterator[None]:
    """Within: megatron-core modules build and run forward/backward on CPU (single process or gloo)."""
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from miles.backends.megatron.compat import patch_megatron

    patch_megatron()
    device, synchronize = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = device, synchronize  # type: ignore[assignment]
        initialize_rng_tracker(force_reset=True)
