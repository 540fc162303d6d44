"""Models: locating/loading checkpoints and the offline tiny model (tokenizer + warmed-up Llama)."""
