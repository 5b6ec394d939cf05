"""Embedding throughput: tokenmill's `LLM.embed` beside sentence-transformers' `encode` on
the same texts and the same model, in one process, one after the other; with the largest
difference between their embeddings (cosine).

    python bench/embeddings.py [--model ST_FOLDER] [--texts 256] [--words 64,256]
        [--batch 32] [--out FILE]

Without `--model`, the bundled SmolLM2-135M (its GGUF dequantized by transformers) is saved
as a sentence-transformers folder (last-token pooling, normalized: Qwen3-Embedding's
recipe) under /tmp. Both run in float32 on the CPU; sentence-transformers pads each batch
of `--batch` texts, tokenmill batches by its token budget."""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import save  # noqa: E402

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
         "tokens", "flow", "through", "the", "mill", "batch", "after", "batch", "block",
         "after", "block", "paris", "is", "the", "capital", "of", "france", "and", "rome",
         "of", "italy"]


def bundled_folder() -> str:
    """The bundled model as a sentence-transformers folder (built once)."""
    folder = "/tmp/tokenmill-bench-embedding"
    if os.path.isfile(os.path.join(folder, "modules.json")):
        return folder
    import transformers as tf
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    from tokenmill.loading.gguf import default_model_path

    gguf = default_model_path()
    base = folder + "-base"
    tok = tf.AutoTokenizer.from_pretrained(os.path.dirname(gguf),
                                           gguf_file=os.path.basename(gguf))
    tok.chat_template = None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    loaded = tf.AutoModel.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                          dtype="float32")
    # (transformers will not save a model it read from GGUF: a plain copy of its weights)
    config = loaded.config
    config.quantization_config = None
    plain = tf.AutoModel.from_config(config, dtype="float32")
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(base)
    tok.save_pretrained(base)
    template = os.path.join(base, "chat_template.jinja")
    if os.path.exists(template):
        os.remove(template)
    transformer = Transformer(base)
    SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(),
                                                      "lasttoken"), Normalize()]).save(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--texts", type=int, default=256)
    ap.add_argument("--words", default="64,256", help="comma-separated words per text")
    ap.add_argument("--batch", type=int, default=32, help="sentence-transformers' batch")
    ap.add_argument("--out")
    args = ap.parse_args()
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from tokenmill import LLM

    folder = args.model or bundled_folder()
    rng = random.Random(0)
    runs = []
    reference = SentenceTransformer(folder, device="cpu")
    llm = LLM(folder, max_model_len=2048, kv_cache_memory_gib=1.0)
    for words in map(int, args.words.split(",")):
        texts = [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(args.texts)]
        tokens = sum(len(reference.tokenizer(t)["input_ids"]) for t in texts)
        llm.embed(texts[:4], use_tqdm=False)  # (warm-up)
        reference.encode(texts[:4], batch_size=args.batch)
        start = time.perf_counter()
        ours = np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
        ours_s = time.perf_counter() - start
        start = time.perf_counter()
        with torch.inference_mode():
            theirs = reference.encode(texts, batch_size=args.batch, convert_to_numpy=True)
        theirs_s = time.perf_counter() - start
        cos = (ours * theirs).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(
            theirs, axis=-1)
        run = {"words": words, "texts": len(texts), "tokens": tokens,
               "tokenmill_s": round(ours_s, 3), "sentence_transformers_s": round(theirs_s, 3),
               "tokenmill_tokens_per_s": round(tokens / ours_s),
               "sentence_transformers_tokens_per_s": round(tokens / theirs_s),
               "speedup": round(theirs_s / ours_s, 2), "min_cosine": float(cos.min())}
        print(run, flush=True)
        runs.append(run)
    llm.shutdown()
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=os.path.dirname(__file__)).stdout.strip()
        save(args.out, commit=commit, model=os.path.basename(folder.rstrip("/")),
             threads=torch.get_num_threads(), batch=args.batch, runs=runs)


if __name__ == "__main__":
    main()
