"""Tasks: datasets of prompts plus a verifiable reward."""
