"""`tokenmill convert`: HF safetensors -> GGUF (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1
written by gguf-py; q2_k .. q6_k by kquants.py; llama.cpp's q4_k_m / q5_k_m mixes as
mixes.py chooses), GGUF -> an HF folder (safetensors, config.json, the tokenizer and chat
template from the file's metadata, weights dequantized to float32), and either -> a
pre-sharded tensor / pipeline-parallel folder (`--tp-size`, sharded.py).
A model argument may be a hub name, as everywhere."""

from __future__ import annotations

import argparse
import os
import sys

from tokenmill.convert.mixes import OUTTYPES


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenmill convert",
        description="Convert a model between formats: an HF folder to one GGUF file (as "
                    "llama.cpp's convert_hf_to_gguf.py writes it: llama.cpp and tokenmill "
                    "read it), or a GGUF file to an HF folder.")
    p.add_argument("model", help="HF folder, .gguf file or hub name ORG/NAME")
    p.add_argument("out", help="the .gguf file, or the HF folder, to write")
    p.add_argument("--outtype", choices=list(OUTTYPES), default=None,
                   help="GGUF weight type of 2-D tensors (default f16; norms and biases f32); "
                        "q4_k_m / q5_k_m: llama.cpp's mixes (some tensors Q6_K); a row that "
                        "is no whole number of blocks takes llama.cpp's fallback type")
    p.add_argument("--tp-size", "--tp_size", dest="tp_size", type=int, default=None,
                   help="write a folder pre-sharded for this many tensor-parallel ranks: "
                        "rank{i}.safetensors, each rank's share only, loaded as it is (a "
                        "block-FP8 source's float8 weights kept unless "
                        "TOKENMILL_FP8_BLOCKS=dequantize)")
    p.add_argument("--pp-size", "--pp_size", dest="pp_size", type=int, default=1,
                   help="with --tp-size: pipeline stages too (rank = stage x tp + tp rank)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tp-size: MoE experts whole per rank, as served with "
                        "--enable-expert-parallel")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="with --tp-size: the files' float type (default the source's)")
    return p


def _gguf_arch(hf_architecture: str) -> str:
    from tokenmill.loading.gguf_archs import ARCHITECTURES

    if hf_architecture == "DeepseekV3ForCausalLM":
        return "deepseek2"
    if hf_architecture in ("MistralForCausalLM", "MixtralForCausalLM"):  # (as llama.cpp's
        return "llama"                                                   # converter does)
    if hf_architecture == "GraniteMoeSharedForCausalLM":
        return "granitemoe"
    for arch, (hf, _) in ARCHITECTURES.items():
        if hf == hf_architecture:
            return arch
    supported = sorted({hf for hf, _ in ARCHITECTURES.values()}
                       | {"DeepseekV3ForCausalLM", "MixtralForCausalLM",
                          "GraniteMoeSharedForCausalLM"})
    raise ValueError(f"{hf_architecture} cannot be written to GGUF; supported: "
                     f"{', '.join(supported)}.")


def to_gguf(model: str, out: str, outtype: str) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from tokenmill.convert.gguf_writer import write_gguf

    # Never trust_remote_code=None: transformers would ask on the terminal whether to run a
    # checkpoint's own code (config.json `auto_map`), and run it on "y". load_hf_config refuses
    # such a folder by name first.
    from tokenmill.loading.checkpoint import load_hf_config
    from tokenmill.loading.file_checks import check_safetensors

    load_hf_config(model)
    config = AutoConfig.from_pretrained(model, trust_remote_code=False)
    arch = _gguf_arch((config.architectures or [""])[0])
    window = getattr(config, "sliding_window", None)
    if arch in ("llama", "starcoder2") and window and window < config.max_position_embeddings:
        sys.stderr.write(f"warning: llama.cpp's {arch} files have no sliding window; this "
                         f"model's ({window} tokens) is dropped, as llama.cpp's converter "
                         "drops it.\n")
    state: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(model)):
        if name.endswith(".safetensors"):
            check_safetensors(os.path.join(model, name))
            state.update(load_file(os.path.join(model, name)))
    if not state:
        raise ValueError(f"{model} has no *.safetensors weights.")
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # (llama.cpp's files tie by leaving it out)
    tmp = out + ".tmp"
    write_gguf(tmp, arch, state, config, outtype=outtype,
               tokenizer=AutoTokenizer.from_pretrained(model, trust_remote_code=False))
    os.replace(tmp, out)  # (a half-written file never has the final name)


def to_hf(model: str, out: str) -> None:
    from safetensors.torch import save_file

    from tokenmill.loading.gguf import iter_gguf_weights, load_gguf_config
    from tokenmill.loading.gguf_tokenizer import load_gguf_tokenizer

    config = load_gguf_config(model)
    rope = getattr(config, "rope_parameters", None) or {}
    if "freq_factors" in rope:  # (Llama 3.1 files: transformers wants the parameters)
        from tokenmill.convert.gguf_keys import llama3_rope_from_factors

        found = llama3_rope_from_factors(config, rope)
        if found is None:
            sys.stderr.write("warning: the file's rope_freqs match no Llama-3 scaling; "
                             "config.json keeps them as `freq_factors` (tokenmill reads them, "
                             "transformers does not).\n")
        else:
            config.rope_parameters = found
    tmp = out.rstrip("/") + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    weights = {name: w.contiguous() for name, w in iter_gguf_weights(model, config)}
    if config.model_type.startswith(("deepseek", "glm4_moe")):  # (transformers': plural)
        weights = {n.replace(".shared_expert.", ".shared_experts."): w
                   for n, w in weights.items()}
    if config.model_type == "mixtral":  # (Mixtral checkpoints' own names)
        from tokenmill.models.moe import mixtral_name

        weights = {mixtral_name(n, to_checkpoint=True): w for n, w in weights.items()}
    if config.model_type.startswith("granitemoe"):  # (stacked experts, as its checkpoints)
        from tokenmill.models.granite import granite_moe_checkpoint

        weights = granite_moe_checkpoint(weights)
    if config.model_type == "gpt_oss":
        from tokenmill.models.gpt_oss import gpt_oss_checkpoint

        weights = gpt_oss_checkpoint(weights)
    if config.model_type == "llama4_text":
        from tokenmill.models.llama4 import llama4_checkpoint

        weights = llama4_checkpoint(weights)
    save_file(weights, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(tmp)
    _save_tokenizer(load_gguf_tokenizer(model), tmp)
    if os.path.exists(out):
        raise ValueError(f"{out} exists; give a new folder.")
    os.replace(tmp, out)


def _save_tokenizer(tokenizer, folder: str) -> None:
    """The tokenizer as its class saves it, or, where that class does not load back what it
    saved (transformers names the class after the architecture: a Gemma class rebuilds its
    own pipeline around a byte-level vocabulary), as the generic fast tokenizer with the same
    tokenizer.json."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer.save_pretrained(folder)
    probe = "Paris is the capital of France. 1234 émigré\n  x"
    try:
        if AutoTokenizer.from_pretrained(folder, trust_remote_code=False).encode(probe) == \
                tokenizer.encode(probe):
            return
    except Exception:  # (any failure of that class: the generic one below)
        pass
    specials = {k: getattr(tokenizer, k) for k in ("bos_token", "eos_token", "unk_token",
                                                   "pad_token") if getattr(tokenizer, k)}
    generic = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, **specials)
    generic.chat_template = tokenizer.chat_template
    generic.save_pretrained(folder)


def run(argv: list[str]) -> int:
    from tokenmill.loading.checkpoint import is_gguf, resolve_model_path

    args = make_parser().parse_args(argv)
    try:
        sharding = args.tp_size is not None or args.pp_size != 1
        if not sharding and (args.dtype or args.enable_expert_parallel):
            raise ValueError("--dtype and --enable-expert-parallel go with --tp-size / "
                             "--pp-size (a sharded folder); a GGUF file's type is --outtype.")
        if args.outtype is not None and (sharding or args.model.endswith(".gguf")):
            raise ValueError("--outtype is the type of a GGUF file written from an HF model; "
                             "a sharded folder's float type is --dtype.")
        model = resolve_model_path(args.model)
        if sharding:
            import torch

            from tokenmill.convert import sharded
            sharded.write(model, args.out, args.tp_size or 1, args.pp_size,
                          args.enable_expert_parallel,
                          getattr(torch, args.dtype) if args.dtype else None)
        elif is_gguf(model):
            to_hf(model, args.out)
        else:
            if not args.out.endswith(".gguf"):
                raise ValueError("The output of an HF model is a .gguf file: name it *.gguf.")
            to_gguf(model, args.out, args.outtype or "f16")
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    sys.stdout.write(args.out + "\n")
    return 0
