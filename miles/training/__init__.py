"""Trainer-side components that are not a backend: checkpoint management."""
