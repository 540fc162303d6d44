"""Weight sync: trainer publishes versioned payloads, rollout workers fetch, verify and apply."""
