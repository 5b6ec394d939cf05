"""Error of `tokenmill convert`'s K-quant encoders against llama.cpp's own quantizer.

Builds a random Llama-shaped model with transformers, writes it as an f32 GGUF, then in each
K-quant type with tokenmill's writer (what `tokenmill convert --outtype q2_k` .. writes) and,
where llama-cpp-python is installed (`--llama-cpp PYTHON`), with llama.cpp's
`llama_model_quantize` in its pure mode (every tensor in the type); reports each file's
relative RMS error per 2-D weight against the f32 source, as gguf-py dequantizes it.

    python bench/kquant_error.py --llama-cpp ~/.cache/tokenmill-peers/llamacpp/bin/python \
        --out bench/results/kquant-error-DATE.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

TYPES = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
PURE = ("import sys, llama_cpp as l\np = l.llama_model_quantize_default_params()\n"
        "p.ftype = getattr(l, 'LLAMA_FTYPE_MOSTLY_' + sys.argv[3])\np.pure = True\n"
        "sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")


def _errors(path: str, source: dict[str, np.ndarray]) -> dict[str, tuple[str, float]]:
    import gguf
    from gguf.quants import dequantize

    out = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.tensor_type.name in ("F32", "F16", "BF16"):
            continue
        ref = source[t.name]
        back = dequantize(t.data, t.tensor_type).reshape(ref.shape)
        out[t.name] = (t.tensor_type.name,
                       float(np.sqrt(((back - ref) ** 2).mean() / (ref ** 2).mean())))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-cpp", default=None, help="a Python with llama-cpp-python")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import gguf
    import torch
    import transformers as tf

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        config = tf.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                                num_hidden_layers=2, num_attention_heads=16,
                                num_key_value_heads=4, vocab_size=512)
        src = os.path.join(tmp, "model")
        tf.LlamaForCausalLM(config).save_pretrained(src)
        from tokenmill.convert.gguf_writer import write_gguf
        from tokenmill.loading.checkpoint import iter_safetensors

        state = dict(iter_safetensors(src))
        f32 = os.path.join(tmp, "f32.gguf")
        write_gguf(f32, "llama", state, config)
        source = {t.name: np.array(t.data, dtype=np.float32)
                  for t in gguf.GGUFReader(f32).tensors}
        rows = {}
        for outtype in TYPES:
            ours = os.path.join(tmp, f"ours-{outtype}.gguf")
            write_gguf(ours, "llama", state, config, outtype=outtype)  # (= tokenmill convert)
            row = {"tokenmill": _errors(ours, source)}
            if args.llama_cpp:
                theirs = os.path.join(tmp, f"llamacpp-{outtype}.gguf")
                ftype = outtype.upper() + ("_M" if outtype in ("q3_k", "q4_k", "q5_k") else "")
                subprocess.run([args.llama_cpp, "-c", PURE, f32, theirs, ftype], check=True,
                               capture_output=True)
                row["llama.cpp"] = _errors(theirs, source)
            rows[outtype] = row
            summary = {k: round(float(np.mean([e for _, e in v.values()])), 4)
                       for k, v in row.items()}
            print(outtype, "mean relative RMS error:", summary)
    result = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
              "machine": platform.processor() or platform.machine(),
              "shape": {"hidden": args.hidden, "intermediate": args.intermediate},
              "errors": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
