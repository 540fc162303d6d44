"""Run monitoring: the snapshot model, its rich view, Prometheus export and end-of-run plots."""
