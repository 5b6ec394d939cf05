"""`ModelConfig`: the model as the engine resolved it at start-up (vLLM's name) — its local
path, its config.json and the context length served — carried beside the `EngineConfig` to
the runner, the worker processes and the proposers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    path: str  # a local folder or .gguf file (hub names resolved before)
    hf_config: Any  # transformers' PretrainedConfig of the checkpoint
    max_model_len: int  # the context served: --max-model-len, else the model's (models/info.py)
