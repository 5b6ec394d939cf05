"""`ModelConfig`: the model as the engine resolved it at start-up (vLLM's name) — its local
path, its config.json, the context length served and, for a pooling model, its pooler —
carried beside the `EngineConfig` to the runner, the worker processes and the proposers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.config.multimodal import MultiModalConfig, resolve_multimodal
from tokenmill.config.pooling import PoolerConfig, resolve_pooler, wants_pooling


@dataclass(frozen=True)
class ModelConfig:
    path: str  # a local folder or .gguf file (hub names resolved before)
    hf_config: Any  # transformers' PretrainedConfig of the checkpoint
    max_model_len: int  # the context served: --max-model-len, else the model's (models/info.py)
    # --runner pooling (or auto, for an embedding / classifier folder): how it pools; None:
    # a generative model
    pooler: PoolerConfig | None = None
    # an image-text model's (LLaVA, Qwen2-VL): its image token and rows; None: text only
    multimodal: MultiModalConfig | None = None

    @classmethod
    def of(cls, config: Any, path: str, hf_config: Any, max_model_len: int,
           multimodal: MultiModalConfig | None = None) -> ModelConfig:
        """Resolved from the engine's `config` (its runner and pooler override);
        `multimodal`: an mmproj file's image side (loading/mmproj.py), for a GGUF."""
        pooler = None
        if wants_pooling(config.runner, hf_config, path):
            pooler = resolve_pooler(path, hf_config, config.pooler_config)
            if config.speculative_config is not None or config.pipeline_parallel_size > 1:
                raise ValueError("A pooling model runs without speculative decoding and "
                                 "pipeline parallel (tensor parallel works).")
        elif config.pooler_config:
            raise ValueError("--pooler-config is for a pooling model: add --runner pooling.")
        if multimodal is None:
            multimodal = resolve_multimodal(path, config.limit_mm_per_prompt, max_model_len)
        return cls(path, hf_config, max_model_len, pooler, multimodal)
