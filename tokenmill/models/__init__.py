"""One file per model family, the registry of architectures, and what the engine reads of a
model without building it (info.py)."""
