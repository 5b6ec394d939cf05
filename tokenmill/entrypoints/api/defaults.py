"""Each front end's sampling defaults, in one table: what a request that leaves a field out
gets. They differ on purpose, each as the system it replaces answers: the seed's native API
samples at temperature 0.95 and top_p 0.7 (PaddleNLP's `add_default_params`), OpenAI and
Triton / TensorRT-LLM at temperature 1.0, `tokenmill generate` greedily, and the offline `LLM`
takes `SamplingParams`' own defaults (vLLM's: temperature 1.0). An OpenAI request's unset
fields take the model's generation_config.json first (config/generation.py)."""

from __future__ import annotations

# The seed's native API, in its field names (spec §1.4.1).
NATIVE = {"min_dec_len": 1, "topp": 0.7, "temperature": 0.95, "penalty_score": 1.0,
          "frequency_score": 0.0, "presence_score": 0.0, "timeout": 300}

# OpenAI completions and chat completions (max_tokens: the room left in the context).
OPENAI = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
          "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}

# Triton's generate API and the gRPC `ensemble` (TensorRT-LLM's input names).
TRITON = {"max_tokens": 16, "temperature": 1.0, "top_k": 0, "top_p": 0.0,
          "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
          "min_tokens": 0, "min_length": 0, "beam_width": 1, "length_penalty": 1.0}

# `tokenmill generate` (one prompt from the command line).
CLI = {"max_tokens": 128, "temperature": 0.0, "top_p": 1.0}
