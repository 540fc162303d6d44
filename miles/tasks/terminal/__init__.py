"""Terminal tasks: Harbor task folders played one shell command per turn in a sandbox (docs/agents.md)."""
