"""A Gemma3ForConditionalGeneration checkpoint (Gemma 3 4B-27B ship only as that) on text
prompts: transformers' multimodal model's greedy tokens, its language model built as
Gemma3ForCausalLM (the vision tower apart from it; images: test_gemma3_vision.py)."""

import torch
from helpers import make_tokenizer

from tokenmill import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 200, 3, 45, 67], list(range(10, 70)), [7, 8]]


def test_text_of_a_multimodal_checkpoint(tmp_path):
    import transformers as tf

    text = tf.Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                               sliding_window_pattern=2, max_position_embeddings=1024,
                               rope_local_base_freq=100.0, initializer_range=0.2,
                               eos_token_id=1, bos_token_id=2, pad_token_id=0)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, image_size=28, patch_size=14)
    config = tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                             mm_tokens_per_image=4, image_token_index=500,
                             boi_token_index=501, eoi_token_index=502)
    torch.manual_seed(0)
    hf = tf.Gemma3ForConditionalGeneration(config).eval()
    path = str(tmp_path / "gemma3mm")
    hf.save_pretrained(path)
    make_tokenizer(path)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with LLM(path, kv_cache_memory_gib=0.01) as llm:
        model = llm.engine.core.runner.model
        assert type(model).__name__ == "Gemma3ForCausalLM"
        assert not any("vision" in name for name, _ in model.named_parameters())
        ours = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    with torch.no_grad():
        theirs = [hf.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):]
                  .tolist() for p in PROMPTS]
    assert ours == theirs
