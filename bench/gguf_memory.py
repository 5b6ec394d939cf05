"""Resident memory of one GGUF file served offline, tokenmill beside llama.cpp in one run.

Each engine runs in a process of its own: it loads the file with a context of `--ctx` tokens,
generates `--tokens` tokens for one short prompt, and reports its resident set after loading
and after generating (VmRSS: anonymous memory and the file pages it maps) and its peak
(VmHWM). llama.cpp runs through llama-cpp-python from `bench/peers/install.sh llamacpp`
(its default: the weights used in place from the mapped file).

    python bench/gguf_memory.py FILE.gguf [--ctx 4096] [--tokens 16] [--out result.json]
    python bench/gguf_memory.py --make DIR   # writes DIR/qwen2-0.5b-shape-q4_k_m.gguf

`--make` writes the file measured in bench/results/gguf-memory-*.json: Qwen2-0.5B's shape
(hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, tied embeddings) with random
weights and the bundled SmolLM2 tokenizer (49,152 tokens, so llama.cpp loads it too),
converted to llama.cpp's Q4_K_M by `tokenmill convert`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import save  # noqa: E402

PEERS = os.environ.get("TOKENMILL_PEERS_DIR", os.path.expanduser("~/.cache/tokenmill-peers"))

_STATUS = '''
def status():
    d = dict(l.split(":", 1) for l in open("/proc/self/status"))
    return {k: int(d[k].split()[0]) // 1024 for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}
'''

TOKENMILL = _STATUS + '''
import json, sys
from tokenmill import LLM, SamplingParams
path, ctx, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM(path, max_num_seqs=1, max_model_len=ctx)  # (KV: one full context, by default)
loaded = status()
llm.generate(["Hello there"], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
             use_tqdm=False)
print(json.dumps({"loaded": loaded, "generated": status()}))
'''

LLAMACPP = _STATUS + '''
import json, sys
from llama_cpp import Llama
path, ctx, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(path, n_ctx=ctx, n_threads=2, verbose=False)
loaded = status()
llm("Hello there", max_tokens=n, temperature=0)
print(json.dumps({"loaded": loaded, "generated": status()}))
'''


def make(folder: str) -> str:
    import torch
    import transformers as tf

    from tokenmill.loading.gguf import default_model_path
    from tokenmill.loading.gguf_tokenizer import load_gguf_tokenizer

    tok = load_gguf_tokenizer(default_model_path())
    config = tf.Qwen2Config(vocab_size=len(tok), hidden_size=896, intermediate_size=4864,
                            num_hidden_layers=24, num_attention_heads=14,
                            num_key_value_heads=2, max_position_embeddings=32768,
                            tie_word_embeddings=True, rope_theta=1e6,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    hf = os.path.join(folder, "hf")
    tf.Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(hf)
    tok.save_pretrained(hf)
    out = os.path.join(folder, "qwen2-0.5b-shape-q4_k_m.gguf")
    subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli", "convert", hf, out,
                    "--outtype", "q4_k_m"], check=True)
    return out


def run(python: str, code: str, args) -> dict:
    out = subprocess.run([python, "-c", code, args.file, str(args.ctx), str(args.tokens)],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"{python}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file", nargs="?")
    ap.add_argument("--make", metavar="DIR", help="write the 0.5B-shaped test file there")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.make:
        print(make(args.make))
        return
    if not args.file:
        ap.error("a .gguf file to measure (or --make DIR)")
    results = {"tokenmill": run(sys.executable, TOKENMILL, args)}
    llamacpp = os.path.join(PEERS, "llamacpp", "bin", "python")
    if os.path.exists(llamacpp):
        results["llama.cpp"] = run(llamacpp, LLAMACPP, args)
    print(f"{'engine':<10} {'peak MB':>8} {'loaded MB':>10} {'after generate MB':>18}")
    for engine, r in results.items():
        print(f"{engine:<10} {r['generated']['VmHWM']:>8} {r['loaded']['VmRSS']:>10} "
              f"{r['generated']['VmRSS']:>18}")
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=os.path.dirname(__file__)).stdout.strip()
        save(args.out, commit=commit, file=os.path.basename(args.file),
             size_mb=os.path.getsize(args.file) // 2**20, ctx=args.ctx, tokens=args.tokens,
             results=results)


if __name__ == "__main__":
    main()
