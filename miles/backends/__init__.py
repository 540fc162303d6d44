"""Training backends: one interface (:class:`miles.backends.base.TrainBackend`)."""
