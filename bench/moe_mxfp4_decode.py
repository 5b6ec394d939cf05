"""Batch-1 decode of a gpt-oss-shaped mixture of experts with MXFP4 experts: tokenmill beside
llama.cpp on the same GGUF file, in one run.

  python bench/moe_mxfp4_decode.py [--layers 4] [--hidden 2880] [--experts 32] [--top-k 4]
                                   [--tokens 64] [--repeats 3] [--rounds 3] [--out FILE]

The file is written here with random weights: gpt-oss-20b's layer shape (hidden 2880,
experts of 2880, 32 experts with 4 active, 64 query / 8 key-value heads of 64, sinks,
window-128 and full layers alternating) over fewer layers and a 32000-token vocabulary;
experts in MXFP4 (random codes, block exponents near gpt-oss' own), attention and
embeddings in Q8_0, as llama.cpp's gpt-oss files hold them. On AVX-512 VNNI CPUs tokenmill
keeps the experts as 4-bit codes (4.5 bits a weight with their bfloat16 scales; the int8
form, 8.5, elsewhere), llama.cpp multiplies them as stored (4.25). The rate is (N - 1)
tokens over the time between the first and the last of N greedy tokens after a 32-token
prompt (EOS ignored / banned), the best of --repeats, each engine in its own process with
both cores; the engines take turns for --rounds rounds and each one's median is reported.
llama.cpp runs in its peer venv (bench/peers/install.sh llamacpp)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
PEER_PYTHON = os.path.join(os.environ.get("TOKENMILL_PEERS_DIR", os.path.expanduser(
    "~/.cache/tokenmill-peers")), "llamacpp", "bin", "python")
VOCAB = 32000

# one engine's measurement, in its own process: argv = gguf, tokenizer folder, tokens, repeats
TOKENMILL = """
import json, sys, time
from tokenmill import LLM, SamplingParams
path, tok, n, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = LLM(path, tokenizer=tok, kv_cache_memory_gib=0.5, enable_prefix_caching=False)
prompt = {"prompt_token_ids": list(range(100, 132))}
def run(k):
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=k, ignore_eos=True),
                 use_tqdm=False)
    return time.perf_counter() - start
run(4)
best = max((n - 1) / (run(n) - run(1)) for _ in range(repeats))
print(json.dumps({"tok_s": best}))
"""
LLAMACPP = """
import json, sys, time
from llama_cpp import Llama
path, n, repeats = sys.argv[1], int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_ctx=512, n_threads=2, n_batch=64, verbose=False)
prompt = list(range(100, 132))
ban = {llm.token_eos(): -1e9}
def run(k):
    llm.reset()
    start = time.perf_counter()
    llm.create_completion(prompt, max_tokens=k, temperature=0.0, logit_bias=ban)
    return time.perf_counter() - start
run(4)
best = max((n - 1) / (run(n) - run(1)) for _ in range(repeats))
print(json.dumps({"tok_s": best}))
"""


def _q8_0(rng, rows: int, cols: int) -> np.ndarray:
    """Random Q8_0 blocks of a [rows, cols] weight (fp16 scale, 32 int8 values each)."""
    blocks = np.empty((rows, cols // 32, 34), dtype=np.uint8)
    scale = np.full((rows, cols // 32), 0.02 / 127, dtype=np.float16)
    blocks[..., :2] = scale.view(np.uint8).reshape(rows, cols // 32, 2)
    blocks[..., 2:] = rng.integers(-127, 128, (rows, cols // 32, 32), dtype=np.int8).view(
        np.uint8)
    return blocks.reshape(rows, -1)


def _mxfp4(rng, experts: int, rows: int, cols: int) -> np.ndarray:
    """Random MXFP4 blocks (E8M0 exponent near 2^-6, 16 bytes of codes each)."""
    blocks = rng.integers(0, 256, (experts, rows, cols // 32, 17), dtype=np.uint8)
    blocks[..., 0] = rng.integers(118, 124, (experts, rows, cols // 32), dtype=np.uint8)
    return blocks.reshape(experts, rows, -1)


def write_model(folder: str, layers: int, hidden: int, experts: int, top_k: int) -> str:
    """The GGUF file (and a word-level tokenizer folder beside it for tokenmill)."""
    import gguf
    from gguf import GGMLQuantizationType as T

    sys.path.insert(0, os.path.join(HERE, "peers"))
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token=f"t{VOCAB - 1}",
                            bos_token="t1").save_pretrained(folder)
    path = os.path.join(folder, "model.gguf")
    rng = np.random.default_rng(0)
    heads, kv_heads, head_dim = 64, 8, 64
    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(hidden)
    w.add_expert_feed_forward_length(hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(150000.0)
    w.add_expert_count(experts)
    w.add_expert_used_count(top_k)
    w.add_sliding_window(128)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_token_types([1] * VOCAB)
    w.add_token_merges(["t 0"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(VOCAB - 1)

    def f32(*shape, scale=0.02):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w.add_tensor("token_embd.weight", _q8_0(rng, VOCAB, hidden), raw_dtype=T.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", _q8_0(rng, VOCAB, hidden), raw_dtype=T.Q8_0)
    for i in range(layers):
        b = f"blk.{i}."
        for name, rows in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim),
                           ("attn_v", kv_heads * head_dim)):
            w.add_tensor(b + name + ".weight", _q8_0(rng, rows, hidden), raw_dtype=T.Q8_0)
            w.add_tensor(b + name + ".bias", f32(rows))
        w.add_tensor(b + "attn_output.weight", _q8_0(rng, hidden, heads * head_dim),
                     raw_dtype=T.Q8_0)
        w.add_tensor(b + "attn_output.bias", f32(hidden))
        w.add_tensor(b + "attn_sinks.weight", f32(heads, scale=1.0))
        w.add_tensor(b + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(b + "post_attention_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(b + "ffn_gate_inp.weight", f32(experts, hidden))
        w.add_tensor(b + "ffn_gate_inp.bias", f32(experts))
        for kind in ("gate", "up", "down"):
            w.add_tensor(f"{b}ffn_{kind}_exps.weight", _mxfp4(rng, experts, hidden, hidden),
                         raw_dtype=T.MXFP4)
            w.add_tensor(f"{b}ffn_{kind}_exps.bias", f32(experts, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main() -> None:
    sys.path.insert(0, HERE)
    from record import save

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="moe-mxfp4-") as folder:  # (a 1.9 GB file)
        rows = _measure(args, write_model(folder, args.layers, args.hidden, args.experts,
                                          args.top_k), folder)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip()
    out = args.out or os.path.join(HERE, "results", "moe-mxfp4-decode.json")
    save(out, commit=commit, shape=vars(args), results=rows)
    print(json.dumps(rows, indent=1))


def _measure(args, path: str, folder: str) -> dict:
    """Each engine's rate on the file, in its own process, the engines taking turns for
    --rounds rounds (a busy machine's slow spells then fall on both): each round's rates,
    and each engine's median."""
    rows = {"file_mb": round(os.path.getsize(path) / 2**20, 1)}
    engines = {"tokenmill": [sys.executable, "-c", TOKENMILL],
               "llama.cpp": [PEER_PYTHON, "-c", LLAMACPP]}
    if not os.path.exists(PEER_PYTHON):
        del engines["llama.cpp"]
        rows["llama.cpp"] = "not installed (bench/peers/install.sh llamacpp)"
    rounds: dict[str, list] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, command in engines.items():
            done = subprocess.run([*command, path, folder, str(args.tokens),
                                   str(args.repeats)], capture_output=True, text=True,
                                  timeout=3600)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode != 0 or not lines:
                rows[name] = {"error": done.stderr[-600:]}
                return rows
            rounds[name].append(json.loads(lines[-1])["tok_s"])
            print(name, round(rounds[name][-1], 1), flush=True)
    for name, rates in rounds.items():
        rows[name] = {"tok_s": float(np.median(rates)), "rounds": rates}
    if len(rounds) == 2:
        rows["ratio_per_round"] = [a / b for a, b in zip(*rounds.values())]
    return rows


if __name__ == "__main__":
    main()
