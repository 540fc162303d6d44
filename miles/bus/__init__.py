"""The bus: NATS JetStream streams, subjects, the message schema and the weight data plane."""
