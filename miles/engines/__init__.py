"""Generation engines: one interface (:class:`miles.engines.base.Engine`), a registry keyed by ``config.type``.

torch: :mod:`.torch_engine` (loop thread, futures, weights) runs :mod:`.torch_loop` (the continuous-batching
sampling loop) with :mod:`.kv_cache` (cache surgery), :mod:`.sampling` and :mod:`.weight_slot`. SGLang:
:mod:`.sglang_engine` (async HTTP client) and :mod:`.sglang_staging` (weights via disk). :mod:`.batch` runs
many prompts for code that thinks in batches.
"""
