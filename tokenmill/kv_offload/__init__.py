"""The KV cache beyond the engine's own blocks: `disk_store.py`, full blocks' KV as files
that outlive the engine (torch-free: bytes in, bytes out)."""
