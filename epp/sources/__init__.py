"""I/O adapters that feed the core."""
