"""Sandboxes: where an agent's shell commands run (interface in :mod:`miles.sandbox.base`)."""
