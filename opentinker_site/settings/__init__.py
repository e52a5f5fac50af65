"""Settings modules: base (shared, reads the environment), local, production, test."""
