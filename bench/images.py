"""Image-request throughput and the vision encoder's share of it: N requests of one image
each (offline `LLM.generate`, greedy, `--output` tokens), beside the same prompts as text
of the same length (the image's placeholder tokens as plain ones), in one process, without
prefix caching.

    python bench/images.py [--family llava|qwen2.5-vl|gemma3] [--requests 16] [--output 32]
                           [--image-size 224] [--out FILE]

The model (`--family llava`): the bundled SmolLM2-135M (its GGUF dequantized by
transformers) as a LLaVA-1.5 language model under a CLIP ViT-B/16-shaped tower (12 layers,
768 wide, 224 pixels: 196 rows an image) and projector of random weights: the shapes of a
real small VLM, the outputs meaningless. `qwen2.5-vl` and `gemma3`: a language model of
SmolLM2-135M's shape (random weights) under a ViT of the same B/16 shape, Qwen2.5-VL's
(window attention, 2 x 2 patches a row: a 224-pixel image is 64 rows; M-RoPE) or SigLIP
with Gemma 3's projector (pooled to 49 rows; image rows attending both ways). Built once
under /tmp."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import save  # noqa: E402


def build(family: str, image_size: int) -> str:
    if family != "llava":
        return build_random(family, image_size)
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


def build_random(family: str, image_size: int) -> str:
    """A `family` model of random weights: SmolLM2-135M's language shape, a ViT-B/16 tower."""
    folder = f"/tmp/tokenmill-bench-{family}-{image_size}"
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    import torch
    import transformers as tf

    from tokenmill.loading.gguf import default_model_path

    gguf = default_model_path()
    tok = tf.AutoTokenizer.from_pretrained(os.path.dirname(gguf),
                                           gguf_file=os.path.basename(gguf))
    shape = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                 num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                 max_position_embeddings=2048, eos_token_id=0, bos_token_id=1)
    if family == "qwen2.5-vl":
        marks = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
        tok.add_special_tokens({"additional_special_tokens": marks})
        start, pad, end, video = tok.convert_tokens_to_ids(marks)
        text = dict(shape, vocab_size=len(tok), rope_parameters={
            "rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 1e5})
        vision = dict(depth=12, hidden_size=768, out_hidden_size=576, intermediate_size=3072,
                      num_heads=12, window_size=112, fullatt_block_indexes=[3, 7, 11])
        config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                     image_token_id=pad, video_token_id=video,
                                     vision_start_token_id=start, vision_end_token_id=end)
        model_cls = tf.Qwen2_5_VLForConditionalGeneration
        images = tf.Qwen2VLImageProcessor(min_pixels=image_size ** 2,
                                          max_pixels=image_size ** 2)
    else:
        marks = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
        tok.add_special_tokens({"additional_special_tokens": marks})
        boi, eoi, soft = tok.convert_tokens_to_ids(marks)
        text = tf.Gemma3TextConfig(**dict(shape, vocab_size=len(tok)), head_dim=64,
                                   query_pre_attn_scalar=64, sliding_window=512)
        vision = tf.SiglipVisionConfig(hidden_size=768, intermediate_size=3072,
                                       num_hidden_layers=12, num_attention_heads=12,
                                       image_size=image_size, patch_size=16,
                                       vision_use_head=False)
        config = tf.Gemma3Config(text_config=text, vision_config=vision,
                                 mm_tokens_per_image=(image_size // 32) ** 2,
                                 boi_token_index=boi, eoi_token_index=eoi,
                                 image_token_index=soft)
        model_cls = tf.Gemma3ForConditionalGeneration
        images = tf.Gemma3ImageProcessor(size={"height": image_size, "width": image_size})
    torch.manual_seed(0)
    model_cls(config).eval().save_pretrained(folder)
    images.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


PROMPTS = {"llava": "USER: <image>\nDescribe picture {i}. ASSISTANT:",
           "qwen2.5-vl": "USER: <|vision_start|><|image_pad|><|vision_end|>\nDescribe "
                         "picture {i}. ASSISTANT:",
           "gemma3": "USER: <start_of_image>\nDescribe picture {i}. ASSISTANT:"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=sorted(PROMPTS), default="llava")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--out")
    args = ap.parse_args()
    import numpy as np
    import torch
    from PIL import Image

    from tokenmill import LLM, SamplingParams

    folder = build(args.family, args.image_size)
    # (no prefix caching: the text prompts would share their placeholder runs)
    llm = LLM(folder, max_model_len=1024, kv_cache_memory_gib=1.0, enable_prefix_caching=False)
    encoder = llm.engine.core.runner.images
    spent = [0.0]
    encode = encoder.vision.encode

    def timed(images):
        start = time.perf_counter()
        try:
            return encode(images)
        finally:
            spent[0] += time.perf_counter() - start
    encoder.vision.encode = timed
    rng = np.random.default_rng(0)
    prompts = [{"prompt": PROMPTS[args.family].format(i=i),
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
    results = {"family": args.family, "requests": args.requests,
               "prompt_tokens": prompt_tokens,
               "image_rows": outs[0].prompt_token_ids.count(image_token),
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
