"""Models: architecture adapters (experts sites, families, the config rules)."""
