"""The TensorRT-LLM `ensemble` model over gRPC: its input tensors -> the same Python fields
the HTTP generate API takes (api/triton_protocol.py `parse_fields`), and its metadata."""

from __future__ import annotations

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from tokenmill.entrypoints.api.triton_protocol import PERF_INTS

_TEXT = {"text_input", "guided_json", "guided_decoding_guide_type", "guided_decoding_guide"}
_WORDS = {"stop_words", "bad_words"}
_BOOLS = {"stream", "return_log_probs", "exclude_input_in_output", "return_perf_metrics"}
_INTS = {"max_tokens", "top_k", "end_id", "pad_id", "beam_width", "num_return_sequences",
         "min_tokens", "min_length", "random_seed", "seed", "lora_task_id", "priority"}
# TensorRT-LLM's adapter tensors (api/lora_tensors.py registers them under lora_task_id)
_LORA_TENSORS = {"lora_weights", "lora_config"}
_FLOATS = {"temperature", "top_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "length_penalty"}
_INT_TYPES = {"INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"}
_FLOAT_TYPES = {"FP16", "FP32", "FP64"} | _INT_TYPES

# Declared types, as TensorRT-LLM's ensemble config has them (metadata / model config).
_DECLARED = [("text_input", "BYTES"), ("max_tokens", "INT32"), ("stream", "BOOL"),
             ("temperature", "FP32"), ("top_k", "INT32"), ("top_p", "FP32"),
             ("stop_words", "BYTES"), ("bad_words", "BYTES"), ("end_id", "INT32"),
             ("pad_id", "INT32"), ("repetition_penalty", "FP32"), ("presence_penalty", "FP32"),
             ("frequency_penalty", "FP32"), ("min_tokens", "INT32"), ("random_seed", "UINT64"),
             ("beam_width", "INT32"), ("num_return_sequences", "INT32"),
             ("length_penalty", "FP32"), ("return_log_probs", "BOOL"),
             ("exclude_input_in_output", "BOOL"), ("return_perf_metrics", "BOOL"),
             ("guided_decoding_guide_type", "BYTES"), ("guided_decoding_guide", "BYTES"),
             ("guided_json", "BYTES"), ("lora_task_id", "UINT64"), ("lora_weights", "FP16"),
             ("lora_config", "INT32")]
_OUTPUTS = [("text_output", "BYTES"), ("cum_log_probs", "FP32"), ("output_log_probs", "FP32"),
            *((name, "INT64") for name in PERF_INTS), ("acceptance_rate", "FP32")]


def ensemble_metadata(name: str) -> pb.ModelMetadataResponse:
    meta = pb.ModelMetadataResponse.TensorMetadata
    return pb.ModelMetadataResponse(
        name=name, versions=["1"], platform="ensemble",
        inputs=[meta(name=n, datatype=t, shape=[-1]) for n, t in _DECLARED],
        outputs=[meta(name=n, datatype=t, shape=[-1]) for n, t in _OUTPUTS])


def _one(name: str, elements: list):
    if len(elements) != 1:
        raise ValueError(f"input '{name}' must hold exactly one value (batch size 1), got "
                         f"{len(elements)}")
    return elements[0]


def _text(name: str, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"input '{name}' is not valid UTF-8") from None


def ensemble_fields(inputs: dict[str, tuple[str, list[int], list]]) -> tuple[dict, list[int]]:
    """Returns the generate fields and the shape to give `text_output` (that of
    `text_input`: [1] or TensorRT-LLM's batched [1, 1]). Raises ValueError on bad tensors."""
    fields = {}
    for name, (dtype, _shape, elements) in inputs.items():
        if name in _TEXT or name in _WORDS:
            if dtype != "BYTES":
                raise ValueError(f"input '{name}' must be BYTES, got {dtype}")
            if name in _TEXT:
                fields[name] = _text(name, _one(name, elements))
            else:
                fields[name] = [w for w in (_text(name, e) for e in elements) if w]
        elif name in _BOOLS:
            if dtype != "BOOL":
                raise ValueError(f"input '{name}' must be BOOL, got {dtype}")
            fields[name] = bool(_one(name, elements))
        elif name in _INTS:
            if dtype not in _INT_TYPES:
                raise ValueError(f"input '{name}' must be an integer type (INT32), got {dtype}")
            fields[name] = int(_one(name, elements))
        elif name in _LORA_TENSORS:
            wanted = _FLOAT_TYPES - _INT_TYPES if name == "lora_weights" else _INT_TYPES
            if dtype not in wanted:
                raise ValueError(f"input '{name}' must be "
                                 f"{'FP16' if name == 'lora_weights' else 'INT32'}, got {dtype}")
            fields[name] = np.asarray(elements).reshape(_shape)
        elif name in _FLOATS:
            if dtype not in _FLOAT_TYPES:
                raise ValueError(f"input '{name}' must be FP32, got {dtype}")
            fields[name] = float(_one(name, elements))
        else:
            raise ValueError(f"unexpected inference input '{name}'")
    if "text_input" not in inputs:
        raise ValueError("input 'text_input' is required")
    shape = list(inputs["text_input"][1])
    return fields, shape if len(shape) == 2 else [1]
