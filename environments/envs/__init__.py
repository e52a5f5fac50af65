"""The built-in environments; each module registers itself in environments.registry."""
