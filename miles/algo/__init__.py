"""The algorithm layer: advantage estimators, policy losses, off-policy corrections, KL and entropy terms,
as pure torch functions chosen from registries by config (docs/algorithms.md).

Nothing here knows about ranks, models or the bus: a backend supplies per-token log-probs and applies
gradients, and every backend calls the same loss code (:mod:`miles.algo.objective`).
"""
