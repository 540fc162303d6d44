"""Miles: asynchronous RL post-training of LLM agents over NATS JetStream."""

__version__ = "0.1.0"
