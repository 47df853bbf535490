"""The engine: continuous batching of generation requests, no HTTP (see the modules)."""
