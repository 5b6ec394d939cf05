"""Image-request throughput and the vision encoder's share of it: N requests of one image
each (offline `LLM.generate`, greedy, `--output` tokens), beside the same prompts as text
of the same length (the image's placeholder tokens as plain ones), in one process, without
prefix caching.

    python bench/images.py [--requests 16] [--output 32] [--image-size 224] [--out FILE]

The model: the bundled SmolLM2-135M (its GGUF dequantized by transformers) as a LLaVA-1.5
language model under a CLIP ViT-B/16-shaped tower (12 layers, 768 wide, 224 pixels: 196
rows an image) and projector of random weights: the shapes of a real small VLM, the
outputs meaningless. Built once under /tmp."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import save  # noqa: E402


def build(image_size: int) -> str:
    folder = f"/tmp/tokenmill-bench-llava-{image_size}"
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    import torch
    import transformers as tf

    from tokenmill.loading.gguf import default_model_path

    gguf = default_model_path()
    where, name = os.path.dirname(gguf), os.path.basename(gguf)
    loaded = tf.AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype="float32")
    loaded.config.quantization_config = None  # (a plain copy: transformers saves no GGUF model)
    text = tf.AutoModelForCausalLM.from_config(loaded.config, dtype="float32")
    text.load_state_dict(loaded.state_dict())
    tok = tf.AutoTokenizer.from_pretrained(where, gguf_file=name)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token = tok.convert_tokens_to_ids("<image>")
    text.resize_token_embeddings(len(tok))
    vision = tf.CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                 num_attention_heads=12, image_size=image_size, patch_size=16)
    config = tf.LlavaConfig(vision_config=vision, text_config=text.config,
                            image_token_index=image_token)
    torch.manual_seed(0)
    model = tf.LlavaForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    model.save_pretrained(folder)
    tf.CLIPImageProcessor(size={"shortest_edge": image_size},
                          crop_size={"height": image_size, "width": image_size}
                          ).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--out")
    args = ap.parse_args()
    import numpy as np
    import torch
    from PIL import Image

    from tokenmill import LLM, SamplingParams

    folder = build(args.image_size)
    # (no prefix caching: the text prompts would share their placeholder runs)
    llm = LLM(folder, max_model_len=1024, kv_cache_memory_gib=1.0, enable_prefix_caching=False)
    encoder = llm.engine.core.runner.images
    spent = [0.0]
    forward = encoder.vision.forward

    def timed(pixels):
        start = time.perf_counter()
        try:
            return forward(pixels)
        finally:
            spent[0] += time.perf_counter() - start
    encoder.vision.forward = timed
    rng = np.random.default_rng(0)
    prompts = [{"prompt": f"USER: <image>\nDescribe picture {i}. ASSISTANT:",
                "multi_modal_data": {"image": Image.fromarray(
                    rng.integers(0, 255, (300, 400, 3), dtype=np.uint8))}}
               for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # (warm-up)
    spent[0] = 0.0
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    image_s = time.perf_counter() - start
    encoder_s = spent[0]
    image_token = llm.engine.multimodal.image_token_id
    texts = [{"prompt_token_ids": [t if t != image_token else 300 for t in o.prompt_token_ids]}
             for o in outs]
    start = time.perf_counter()
    llm.generate(texts, params, use_tqdm=False)
    text_s = time.perf_counter() - start
    llm.shutdown()
    prompt_tokens = len(outs[0].prompt_token_ids)
    results = {"requests": args.requests, "prompt_tokens": prompt_tokens,
               "image_rows": llm.engine.multimodal.tokens_per_image,
               "output_tokens": args.output, "images_s": round(image_s, 3),
               "images_requests_per_s": round(args.requests / image_s, 2),
               "encoder_s": round(encoder_s, 3),
               "encoder_share": round(encoder_s / image_s, 3),
               "encoder_ms_per_image": round(1000 * encoder_s / args.requests, 1),
               "same_text_s": round(text_s, 3),
               "same_text_requests_per_s": round(args.requests / text_s, 2)}
    print(results)
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=os.path.dirname(__file__)).stdout.strip()
        save(args.out, commit=commit, threads=torch.get_num_threads(),
             image_size=args.image_size, **results)


if __name__ == "__main__":
    main()
