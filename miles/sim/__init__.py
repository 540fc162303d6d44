"""Simulations that drive the project's real scheduling rules on a virtual clock (no GPUs, no bus)."""
