"""KServe v2 tensors <-> Python values: typed `contents` or `raw_input_contents` in, raw
contents out (as Triton answers). BYTES elements travel as a 4-byte little-endian length
followed by the bytes."""

from __future__ import annotations

import math
import struct

import numpy as np
from tritonclient.grpc import service_pb2 as pb

_NUMPY = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
          "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
          "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64}
# Which InferTensorContents field holds each datatype when sent without raw contents.
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
             "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
             "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
             "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}


class TensorError(ValueError):
    """A tensor that cannot be read as declared (the client's protocol error)."""


def serialize_bytes(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def deserialize_bytes(raw: bytes) -> list[bytes]:
    items, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise TensorError("a BYTES tensor ends inside an element length")
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise TensorError("a BYTES tensor element is longer than its buffer")
        items.append(raw[offset:offset + size])
        offset += size
    return items


def read_inputs(request: pb.ModelInferRequest) -> dict[str, tuple[str, list[int], list]]:
    """name -> (datatype, shape, flat list of elements: bytes for BYTES, numbers otherwise)."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise TensorError(f"raw_input_contents has {len(raw)} entries for "
                          f"{len(request.inputs)} inputs")
    values = {}
    for i, tensor in enumerate(request.inputs):
        if tensor.name in values:
            raise TensorError(f"input '{tensor.name}' is given more than once")
        dtype, shape = tensor.datatype, list(tensor.shape)
        if dtype != "BYTES" and dtype not in _NUMPY:
            raise TensorError(f"input '{tensor.name}' has unsupported datatype '{dtype}'")
        if any(d < 0 for d in shape):
            raise TensorError(f"input '{tensor.name}' has a negative dimension in {shape}")
        if raw:
            if dtype == "BYTES":
                elements = deserialize_bytes(raw[i])
            else:
                try:
                    elements = np.frombuffer(raw[i], dtype=_NUMPY[dtype]).tolist()
                except ValueError as exc:
                    raise TensorError(f"input '{tensor.name}': {exc}") from None
        else:
            field = _CONTENTS.get(dtype)
            if field is None:
                raise TensorError(f"input '{tensor.name}' of type {dtype} needs raw contents")
            elements = list(getattr(tensor.contents, field))
        if len(elements) != math.prod(shape):
            raise TensorError(f"input '{tensor.name}' has {len(elements)} elements but shape "
                              f"{shape}")
        values[tensor.name] = (dtype, shape, elements)
    return values


def bytes_output(name: str, items: list[bytes], shape: list[int] | None = None):
    """(output tensor metadata, raw contents) of a BYTES output."""
    tensor = pb.ModelInferResponse.InferOutputTensor(name=name, datatype="BYTES",
                                                     shape=shape or [len(items)])
    return tensor, serialize_bytes(items)


def fp32_output(name: str, values: list[float], shape: list[int]):
    tensor = pb.ModelInferResponse.InferOutputTensor(name=name, datatype="FP32", shape=shape)
    return tensor, np.asarray(values, dtype=np.float32).tobytes()


def int64_output(name: str, values: list[int], shape: list[int]):
    tensor = pb.ModelInferResponse.InferOutputTensor(name=name, datatype="INT64", shape=shape)
    return tensor, np.asarray(values, dtype=np.int64).tobytes()
