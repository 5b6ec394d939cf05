"""Configuration in typed objects, built once at start-up and passed down: engine.py
(`EngineConfig`), speculative.py, kernels.py (kernel switches), server.py (`ServerConfig`),
api.py (`ApiOptions`), cli.py (the `tokenmill serve` flags), parallel.py (a node's place among
several), generation.py (the model's default sampling), env.py (the environment: read there
and nowhere else)."""
