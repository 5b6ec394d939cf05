"""Find a model's config, weights and tokenizer (HF directory or GGUF file) and load them."""

from __future__ import annotations

import contextlib
import copy
import glob
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tokenmill import csrc, heap
from tokenmill.config import kernels as kernel_switches
from tokenmill.config.multimodal import is_image_text
from tokenmill.config.quantization import QuantConfig, checkpoint_quant_config
from tokenmill.distributed.parallel_state import get_tp_group, get_world
from tokenmill.layers.bf16_linear import look_up_in_panels, store_in_bf16, tied_tables
from tokenmill.layers.kernel_choice import choose_linear_kernels
from tokenmill.layers.linear import (
    CheckpointSlice,
    RowParallelLinear,
    deferred_weights,
    whole,
)
from tokenmill.layers.moe import SparseMoE
from tokenmill.loading import sharded
from tokenmill.loading.file_checks import check_config, check_model_folder, check_safetensors
from tokenmill.models.registry import build_model
from tokenmill.models.vision.encoder import VISION_PREFIXES, text_name
from tokenmill.quantization import fp8_blocks
from tokenmill.quantization.mxfp4_experts import Fp4Experts

logger = logging.getLogger(__name__)


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def resolve_model_path(model: str | None, node: tuple[int, int] | None = None,
                       revision: str | None = None, cache_dir: str | None = None) -> str:
    """What to load for a model argument (a path, or a hub name fetched as needed, at
    `revision` into `cache_dir`; `node` (node_rank, nnodes): of a pre-sharded checkpoint,
    that node's ranks' files only)."""
    if model is None:
        from tokenmill.loading.gguf import default_model_path
        return default_model_path()
    if not os.path.exists(model):
        from tokenmill.hub.fetch import looks_like_repo, resolve

        if looks_like_repo(model):  # a hub name: the verified cached copy, else a download
            return resolve_model_path(resolve(model, revision, node=node, cache_dir=cache_dir))
        raise FileNotFoundError(f"Model path {model!r} does not exist: give a local Hugging "
                                "Face model directory (config.json, *.safetensors, tokenizer "
                                "files), a .gguf file, or a hub name ORG/NAME (fetched with "
                                "`tokenmill download ORG/NAME`, or at start-up).")
    if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        ggufs = sorted(glob.glob(os.path.join(model, "*.gguf")))
        if len(ggufs) == 1:
            return ggufs[0]
        raise FileNotFoundError(f"Model directory {model!r} has no config.json.")
    return model


def load_hf_config(path: str) -> Any:
    """The model's (text) config, its sizes checked against sane bounds (file_checks.py)
    before anything is built from them."""
    if is_gguf(path):
        from tokenmill.loading.gguf import load_gguf_config
        config = load_gguf_config(path)
        check_config(config, path)
        return config
    from transformers import AutoConfig
    check_model_folder(path)  # (transformers' JSON reading recurses; its checks divide)
    try:  # (never None: transformers would ask on the terminal whether to run the code)
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except ValueError:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        from tokenmill.models.registry import SUPPORTED_ARCHITECTURES
        if not isinstance(raw, dict) or "auto_map" not in raw:  # (transformers' own message
            # runs to paragraphs of upgrade advice: one line instead)
            kind = raw.get("model_type") if isinstance(raw, dict) else None
            raise ValueError(f"Model {path!r} is of a type transformers does not know "
                             f"({kind!r}), so tokenmill cannot serve it; supported "
                             f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}.") from None
        raise ValueError(f"Model {path!r} needs its own Python code (config.json `auto_map`), "
                         "which tokenmill never runs, --trust-remote-code or not; supported "
                         f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}.") from None
    from tokenmill.models.registry import text_model_config
    config = text_model_config(config)
    check_config(config, path)
    return config


def iter_safetensors(model_dir: str, lazy: bool = False,
                     fp8_block: tuple[int, int] | None = None,
                     keep_fp8: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs; `lazy`: `CheckpointSlice`s that read only what a loader keeps;
    `fp8_block`: float8 weights come dequantized with their block factors, or with
    `keep_fp8` kept as they are where a kernel serves them (fp8_blocks.py)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, name) for name in files]
    else:
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"No *.safetensors weights in {model_dir!r}.")
    for file in files:
        check_safetensors(file)
        with safe_open(file, framework="pt") as f:
            names = list(f.keys())
            if fp8_block is not None:
                yield from fp8_blocks.dequantized(names, f.get_slice, fp8_block, lazy,
                                                  keep_fp8)
                continue
            for name in names:
                yield name, CheckpointSlice(f.get_slice(name)) if lazy else f.get_tensor(name)


def iter_weights(path: str, hf_config: Any, keep_quantized: bool = False,
                 lazy: bool = False, keep_fp8: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs; from GGUF with `keep_quantized`, Q8_0/Q4_0/Q4_1 linear weights
    come as `QuantizedShard`s instead of float tensors; from safetensors with `lazy`,
    `CheckpointSlice`s (a tensor-parallel rank reads its shard only); a block-FP8
    checkpoint's float8 weights with `keep_fp8` as `QuantizedShard`s."""
    if is_gguf(path):
        from tokenmill.loading.gguf import iter_gguf_weights
        return iter_gguf_weights(path, hf_config, keep_quantized)
    return iter_safetensors(path, lazy, fp8_blocks.block_size(hf_config), keep_fp8)


def _quant_config(path: str, hf_config: Any, method: str | None) -> QuantConfig | None:
    stored = checkpoint_quant_config(hf_config)
    if stored is not None and method is not None and method != stored.method:
        raise ValueError(f"Checkpoint {path!r} is already quantized with {stored.method}; "
                         f"it cannot be served as {method}.")
    return stored if stored is not None else QuantConfig(method) if method else None


def load_model(path: str, hf_config: Any, dtype: torch.dtype, device: torch.device,
               max_positions: int, quantization: str | None = None,
               float_weights: bool = False, keep_fp8: bool | None = None,
               mtp: bool = True, head_on_first_stage: bool = False,
               bf16_weights: bool = False, pooling: bool = False) -> nn.Module:
    """Build the model and load its weights; quantized as the checkpoint is, or by
    `quantization` (a method name), then every remaining linear gets its fastest kernel.
    `float_weights`: every linear keeps a plain float weight (GGUF blocks dequantized, no
    packing), as `tokenmill quantize` needs them. `keep_fp8`: a block-FP8 checkpoint's
    float8 weights kept (default: as TOKENMILL_FP8_BLOCKS says for `device`; never with
    `float_weights` unless asked). `mtp`: the multi-token-prediction layers (DeepSeek's,
    Qwen3-Next's) built and loaded (the engine needs them only to speculate with them).
    `head_on_first_stage`: under pipeline parallel the first stage holds the LM head too
    (draft heads run there).
    `bf16_weights` (a float32 model on the CPU): float linears load into bf16 and multiply
    from bf16 panels (layers/bf16_linear.py); quantized ones are untouched.
    `pooling` (a pooling model): a bare decoder's tensors (`layers.0...`, as
    sentence-transformers saves them) load as the causal LM's, a classifier head's are left
    to the pooler (worker/pooler.py), and the LM head is dropped unless tied or stored."""
    from tokenmill.quantization import model as qmodel

    if not mtp and getattr(hf_config, "num_nextn_predict_layers", None) != 0:
        hf_config = copy.copy(hf_config)  # (the checkpoint's MTP tensors then go unread;
        hf_config.num_nextn_predict_layers = 0  # Qwen3-Next's config does not name them)

    quant = _quant_config(path, hf_config, quantization)
    tp = get_tp_group()
    if float_weights and quant is not None:
        raise ValueError(f"Checkpoint {path!r} is already quantized ({quant.method}); "
                         "quantize the original weights.")
    blocks, presharded = fp8_blocks.block_size(hf_config) is not None, sharded.is_sharded(path)
    if blocks and quant is not None and presharded:
        raise ValueError(f"{path} is a pre-sharded folder of float8 weights, served as they "
                         "are (quantizing at load needs whole rows); to quantize, shard the "
                         "original checkpoint with TOKENMILL_FP8_BLOCKS=dequantize.")
    # a block-FP8 checkpoint's float8 weights, served as they are (on GPUs by default): its
    # linears get memory for a float weight only where a loader writes one
    if keep_fp8 is None:
        keep_fp8 = not float_weights and kernel_switches.current().gpu.keep_fp8_blocks(device)
    keep_fp8 = keep_fp8 and quant is None and blocks
    # parameters made in the model's dtype (built in float32 first, a bf16 model took twice
    # its memory on the device before loading); buffers made in float32 on purpose (the
    # rotary tables) are converted after, as before
    with torch.device(device), _default_dtype(dtype), (
            deferred_weights(device) if keep_fp8 else contextlib.nullcontext()):
        model = build_model(hf_config, max_positions, head_on_first_stage=head_on_first_stage)
    model.to(dtype=dtype)
    bf16_weights = bf16_weights and not float_weights
    if bf16_weights and quant is None and not is_gguf(path):  # (GGUF: rounded after loading)
        store_in_bf16(model)
    # quantized at load, or shard files being written: whole-row scales for slices
    if (quant is not None or float_weights) and tp.size > 1:
        for module in model.modules():
            if isinstance(module, RowParallelLinear):
                module.wants_row_absmax = True
    # GGUF's 8/4-bit blocks are served as they are where a kernel reads them directly.
    keep_gguf = (quant is None and not float_weights and device.type == "cpu"
                 and dtype == torch.float32 and csrc.available())
    if presharded:  # this rank's own file (sharded.py)
        loaded, stored = sharded.load_rank(model, path, keep_fp8), False
    else:
        loaded, stored = _load_checkpoint(model, path, hf_config, quant, keep_gguf, keep_fp8,
                                          pooling)
    if pooling and "lm_head.weight" not in loaded and not getattr(model, "tie_word_embeddings",
                                                                  False):
        model.lm_head = None  # (nothing reads logits of a pooling model)
    model.finish_loading(loaded)
    expected = {name for name, _ in model.named_parameters()}
    missing = expected - loaded
    if missing:
        raise ValueError(f"Checkpoint {path!r} lacks weights for: {', '.join(sorted(missing))}.")
    if quant is not None and not stored:
        qmodel.quantize_linears(model, quant)
    if float_weights:
        return model.eval()
    tied = tied_tables(model) if bf16_weights else []
    kernels = choose_linear_kernels(model, bf16_weights)
    look_up_in_panels(tied)
    for module in model.modules():  # experts as grouped Triton matmuls (GPUs), MXFP4 in C
        if isinstance(module, SparseMoE):
            module.fuse_experts()
            if module.fused is None:
                module.fused = Fp4Experts.of(module)
    logger.info("Linear kernels: %s; weights %.1f MiB", kernels,
                qmodel.weight_bytes(model) / 2**20)
    model.eval()
    return model


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def pooling_name(name: str) -> str | None:
    """A pooling checkpoint's tensor name as the causal LM's (None: the pooler's head)."""
    if name.startswith(POOLER_HEADS):
        return None
    if name.startswith(("embed_tokens.", "layers.", "norm.")):
        return "model." + name  # (a bare decoder: LlamaModel's own names)
    return name


POOLER_HEADS = ("score.", "classifier.")


def image_text_name(name: str) -> str | None:
    """An image-text checkpoint's tensor as its language model's (None: the image side's,
    loaded by loading/vision.py)."""
    return None if name.startswith(VISION_PREFIXES) else text_name(name)


def _load_checkpoint(model: nn.Module, path: str, hf_config: Any, quant: QuantConfig | None,
                     keep_gguf: bool, keep_fp8: bool, pooling: bool = False
                     ) -> tuple[set[str], bool]:
    """The parameters loaded from a checkpoint, and whether it held quantized tensors."""
    from tokenmill.quantization import model as qmodel

    stored: dict[str, dict[str, torch.Tensor]] = {}
    shards: dict[str, dict[int | None, qmodel.QuantizedShard]] = {}
    # (a pipeline stage reads only its own layers' tensors)
    lazy = get_world().size > 1
    weights = iter_weights(path, hf_config, keep_gguf, lazy, keep_fp8)
    rename = pooling_name if pooling else image_text_name if is_image_text(path) else None
    if rename is not None:
        weights = ((renamed, t) for name, t in weights
                   if (renamed := rename(name)) is not None)
    ours = ((name, t) for name, t in weights if model.holds(name))
    if hasattr(model, "checkpoint_tensors"):  # (stacked experts, MXFP4: models/)
        ours = model.checkpoint_tensors(ours)
    modules, early = dict(model.named_modules()), set()

    def on_shard(layer: str) -> None:
        """A layer whose GGUF shards have all come gets its kernel now, so its blocks are
        not all held until the last layer's came (they once doubled the peak: a 0.5B
        Q4_K_M file peaked at 1.36 GB to settle at 0.73 GB)."""
        by_index, sizes = shards[layer], getattr(modules.get(layer), "full_sizes", None)
        if None in by_index or (sizes is not None and len(by_index) == len(sizes)):
            early.update(qmodel.load_shards(model, {layer: shards.pop(layer)}))
            heap.trim()  # (the blocks' temporaries: freed, but glibc would keep them)

    weights = qmodel.split_checkpoint(ours, model.checkpoint_target, stored, shards, on_shard)
    loaded = model.load_weights(weights) | early
    if stored:
        if checkpoint_quant_config(hf_config) is None:
            raise ValueError(f"Checkpoint {path!r} has quantized tensors but its config.json "
                             "has no tokenmill quantization_config.")
        loaded |= qmodel.load_kernels(model, quant, stored)
    loaded |= qmodel.load_shards(model, shards)
    _share_tied_rows(model, loaded)
    return loaded, bool(stored)


def _share_tied_rows(model: nn.Module, loaded: set[str]) -> None:
    """A tied embedding table that came only as its LM head's quantized blocks (GGUF): its
    lookups read the head's rows instead of a float copy of the table."""
    head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if not (getattr(model, "tie_word_embeddings", False) and embed is not None
            and head is not None and "model.embed_tokens.weight" not in loaded):
        return
    if head.weight is None:
        embed.share_rows(head)
    elif "lm_head.weight" in loaded:  # the head's blocks were dequantized into the table
        loaded.add("model.embed_tokens.weight")


def load_vision_encoder(path: str, dtype: torch.dtype, device: torch.device,
                        mmproj: str = "") -> nn.Module:
    """An image-text checkpoint's image side (models/vision/encoder.py), its tensors read
    from the checkpoint (only those), or from a GGUF's llama.cpp projector file `mmproj`."""
    from transformers import AutoConfig

    if mmproj:
        from tokenmill.loading.mmproj import load_mmproj_encoder
        return load_mmproj_encoder(mmproj, dtype, device)

    from tokenmill.models.vision.encoder import build_encoder

    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    with torch.device(device):
        encoder = build_encoder(config)
    encoder.load_weights((name, whole(t)) for name, t in iter_safetensors(path, lazy=True)
                         if name.startswith(VISION_PREFIXES))
    return encoder.to(dtype).eval()


def load_tokenizer(path: str) -> Any:
    """The model's tokenizer; a checkpoint's own Python code is never run."""
    if is_gguf(path):
        from tokenmill.loading.gguf_tokenizer import load_gguf_tokenizer
        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer
    check_model_folder(path)  # (it reads the config too)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
