"""vLLM general plugins (entry points in pyproject.toml): each is a no-op unless its variable is set."""
